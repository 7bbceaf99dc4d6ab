"""A recipe that passes but leaves a process running: gpu-check says so and stops it."""

import subprocess
import sys

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(f"child pid {child.pid}", flush=True)
