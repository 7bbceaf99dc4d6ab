"""A recipe that fails: tests/test_gpu_check.py checks that gpu-check records it as failed."""

print("failing_recipe: stall 12.5 ms (a summary line: the table shows it)")
print("a line only the log keeps")
raise RuntimeError("this recipe fails on purpose")
