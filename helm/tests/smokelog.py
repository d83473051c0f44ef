"""What the smoke run's modules share: its log lines (seconds since the run began, then the
message) and running a command."""

import subprocess
import time

T0 = time.time()


def log(msg):
    print(f"smoke: {time.time() - T0:5.1f} s: {msg}", flush=True)


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)
