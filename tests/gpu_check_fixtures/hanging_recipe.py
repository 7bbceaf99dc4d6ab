"""A recipe that hangs, with a child process: gpu-check stops both at its timeout."""

import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(f"child pid {child.pid}", flush=True)
time.sleep(120)
