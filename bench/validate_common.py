"""What bench/plan_validate.py and bench/train_validate.py share: running loom, the load."""
import os
import subprocess
import sys


def run(cmd, who):
    """stdout of cmd; on failure exits naming `who`, the command and its stderr."""
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit(f"{who}: failed: " + " ".join(cmd) + "\n" + r.stderr)
    return r.stdout


def loadavg():
    """The 1-minute load average (NaN where the system has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")
