"""A recipe that fails: tests/test_gpu_check.py checks that gpu-check records it as failed."""

from page_tools import results

results.record("headline", {"stall_ms": 12.5})  # recorded before it failed: the table shows it
results.claim("decided-before-the-failure", True, "a claim that held")
print("a line only the log keeps")
raise RuntimeError("this recipe fails on purpose")
