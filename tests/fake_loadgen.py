"""A stand-in for guidellm that never finishes: it starts a worker (as guidellm's spawn workers are), writes
both process ids to $FAKE_LOADGEN_PIDS and sleeps. Tests check that stopping a run leaves neither behind."""
import os
import subprocess
import sys
import time

worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.environ["FAKE_LOADGEN_PIDS"], "w") as f:
    f.write(f"{os.getpid()} {worker.pid}\n")
time.sleep(600)
