"""A recipe whose processes "use GPUs": it writes, for the fake nvidia-smi, which GPU each
of its two children uses (one of them two GPUs), and one process outside it, then waits
while gpu-check samples."""

import os
import subprocess
import sys
import time

children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in "ab"]
one, two = (child.pid for child in children)
outsider = os.getppid()  # gpu-check itself: not in the recipe's session, never counted
lines = [f"{one}, GPU-aaaa", f"{two}, GPU-bbbb", f"{two}, GPU-aaaa", f"{outsider}, GPU-bbbb"]
with open(os.environ["FAKE_NVIDIA_SMI_APPS"], "w") as apps:
    apps.write("\n".join(lines) + "\n")
print(f"children {one} {two}; outsider {outsider}", flush=True)
time.sleep(2)  # a few samples
# As nvidia-smi, which lists running processes only: the children leave the list first.
open(os.environ["FAKE_NVIDIA_SMI_APPS"], "w").close()
time.sleep(1)  # a sample that no longer sees them, before they are gone
for child in children:
    child.kill()
    child.wait()
