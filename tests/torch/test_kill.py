"""A worker killed mid-call never hangs the job: runs kill_worker.py under loom.torchrun with 3
processes and a hard wall-clock bound, then checks that
  * the launcher returned, non-zero, well within the bound;
  * every surviving rank raised loom.CommError/Timeout naming a peer, within loom's timeout.

    PYTHONPATH=build/python /usr/bin/python3 tests/torch/test_kill.py
"""
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 20.0  # loom's timeout inside the workers
BOUND_S = 120.0   # the launcher must be back long before this

with tempfile.TemporaryDirectory() as tmp:
    env = dict(os.environ, LOOM_KILL_DIR=tmp, LOOM_KILL_TIMEOUT_S=str(TIMEOUT_S),
               OMP_NUM_THREADS="1")
    t0 = time.time()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "loom.torchrun", "--standalone", "--nproc_per_node", "3",
             "--monitor_interval", "1", os.path.join(HERE, "kill_worker.py")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=BOUND_S)
        rc, log = proc.returncode, proc.stdout.decode(errors="replace")
    except subprocess.TimeoutExpired as e:
        print(f"FAIL: the launcher did not return within {BOUND_S} s (a hang)")
        print((e.stdout or b"").decode(errors="replace")[-3000:])
        sys.exit(1)
    wall = time.time() - t0
    failures = []
    if rc == 0:
        failures.append("the launcher returned 0 although a worker was killed")
    reports = {}
    for r in (0, 2):
        path = os.path.join(tmp, f"rank{r}.txt")
        if not os.path.exists(path):
            # The survivors outlast torchrun's SIGTERM (kill_worker.py); no report means
            # loom did not raise before the SIGKILL 30 s later, or the worker crashed.
            failures.append(f"rank {r} wrote no report (it did not raise before the launcher ended it)")
            continue
        elapsed, asked, what = open(path).read().split("\n", 2)
        reports[r] = (float(elapsed), asked, what.strip())
        if not (what.startswith("CommError") or what.startswith("Timeout")):
            failures.append(f"rank {r}: wanted CommError/Timeout, got: {what.strip()}")
        elif "rank" not in what:
            failures.append(f"rank {r}: the error does not name a rank: {what.strip()}")
        if float(elapsed) > TIMEOUT_S + 5:
            failures.append(f"rank {r} raised after {elapsed} s, past the {TIMEOUT_S} s timeout")
    for r, (elapsed, asked, what) in sorted(reports.items()):
        print(f"rank {r} raised after {elapsed:.2f} s ({asked}): {what[:300]}")
    print(f"launcher returned {rc} after {wall:.1f} s")
    if failures:
        print(log[-4000:])
        for f in failures:
            print("FAIL:", f)
        sys.exit(1)
    print("test_kill: ok")
