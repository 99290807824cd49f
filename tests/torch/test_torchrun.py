"""loom.torchrun's --redirects / --tee, and its port choice.

--redirects and --tee take 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per local rank i:v,j:w,
as torchrun documents; torch's own parse gives None for 0 and 3 on Python 3.11 (iterating the
Std flag enum yields only OUT and ERR), and 3 became NONE without a word. Anything else is refused
with one line before any worker starts.

The workers' MASTER_PORT that torchrun's agent publishes lies
outside the kernel's ephemeral port range once loom.torchrun has patched it (torch's own choice
lies inside it, where any outgoing connection's source port can take it before rank 0 binds it:
the "errno: 98 - Address already in use" that once failed torch_cp_np3).

    PYTHONPATH=build/python /usr/bin/python3 tests/torch/test_torchrun.py
"""
import os
import socket
import subprocess
import sys
import tempfile
import time

from torch.distributed import HashStore
from torch.distributed.elastic.agent.server import api as agent_api

import loom.torchrun as lr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Checks  # noqa: E402

check = Checks()


def published_port():
    # master_addr given: the port is chosen all the same, and no fully qualified host name is
    # looked up (socket.getfqdn, 0.1 s or more each).
    store = HashStore()
    agent_api.SimpleElasticAgent._set_master_addr_port(store, "localhost", None)
    return int(store.get("MASTER_PORT").decode())


def bindable(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("localhost", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


low, high = lr.ephemeral_range()
check(1024 <= low <= high <= 65535, f"ephemeral range {low}-{high} read")

# Unpatched, torch draws from the ephemeral range: the race this wrapper removes.
stock = [published_port() for _ in range(10)]
check(all(low <= p <= high for p in stock), f"torch's own ports {stock} lie in {low}-{high}")

lr._patch()
Std = lr._api.Std
for text, want in (("0", Std.NONE), ("1", Std.OUT), ("2", Std.ERR), ("3", Std.ALL),
                   ("0:3,1:1", {0: Std.ALL, 1: Std.OUT}), ("1:0,0:2", {1: Std.NONE, 0: Std.ERR}),
                   ("12:3", {12: Std.ALL})):
    got = Std.from_str(text)
    check(got == want and type(got) is type(want), f"Std.from_str({text!r}) = {got!r}, want {want!r}")
for text in ("4", "", "-1", "0:4", "0:3,", "a", "0:3,0:1", "1,2"):
    try:
        Std.from_str(text)
        check(False, f"Std.from_str({text!r}) refused")
    except ValueError as e:
        check(repr(text) in str(e) and ("twice" in str(e) or "3 (both)" in str(e)),
              f"Std.from_str({text!r}): clear error ({e})")
for argv, want in ((["--redirects", "0:1,1:3"], None), (["--tee", "3"], None),
                   (["--redirects", "5"], "loom.torchrun: --redirects: '5' is not 0 (none)"),
                   (["--tee", "0:3,2:1"], "loom.torchrun: --tee 0:3,2:1: local rank 2 does not "
                                          "exist (--nproc_per_node 2: local ranks 0 to 1)")):
    try:
        lr.check_std_args(lr._run.parse_args(["--nproc_per_node", "2"] + argv + ["x.py"]))
        check(want is None, f"{argv} refused")
    except SystemExit as e:
        check(want is not None and str(e.code).startswith(want), f"{argv}: {e.code}")

ports = [published_port() for _ in range(100)]
outside = [p for p in ports if not low <= p <= high]
check(len(outside) == len(ports),
      f"patched: {len(ports) - len(outside)} of {len(ports)} ports inside {low}-{high}")
check(all(1024 <= p <= 65535 for p in ports), "patched ports are unprivileged")
check(len(set(ports)) > 50, f"patched ports are drawn at random ({len(set(ports))} distinct)")
check(all(bindable(p) for p in ports[:20]), "the published port is free once the agent closed it")

# A port another socket holds is never chosen: hold one, exhaust the candidates around it.
held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
held.bind(("localhost", 0 if high == 65535 else high + 1))
held.listen(1)
held_port = held.getsockname()[1]
original = lr.candidate_ports
lr.candidate_ports = lambda lo, hi: [held_port] + [p for p in original(lo, hi) if p != held_port]
try:
    s = lr.socket_with_port_outside_ephemeral_range()
    got = s.getsockname()[1]
    s.close()
    check(got != held_port, f"a held port ({held_port}) is skipped (got {got})")
    lr.candidate_ports = lambda lo, hi: [held_port]
    try:
        lr.socket_with_port_outside_ephemeral_range()
        check(False, "no free candidate raises")
    except RuntimeError as e:
        check("no free port" in str(e), f"no free candidate: clear error ({e})")
finally:
    lr.candidate_ports = original
    held.close()

# The range file: parsed when sane, Linux's default otherwise.
with tempfile.TemporaryDirectory() as d:
    for text, want in (("40000\t50000\n", (40000, 50000)), ("garbage", (32768, 60999)),
                       ("50000 40000", (32768, 60999)), ("10 20", (32768, 60999))):
        path = os.path.join(d, "range")
        with open(path, "w") as f:
            f.write(text)
        check(lr.ephemeral_range(path) == want, f"range file {text!r} -> {want}")
    check(lr.ephemeral_range(os.path.join(d, "missing")) == (32768, 60999), "missing range file")
cands = lr.candidate_ports(40000, 50000)
check(not any(40000 <= p <= 50000 for p in cands) and len(cands) == 65535 - 1024 + 1 - 10001,
      "candidates are every unprivileged port outside the range")

# --standalone: every job its own rendezvous store, on a free port outside the ephemeral range
# (torch's is 29400, always).
args = lr.standalone_args(lr._run.parse_args(["--standalone", "--nproc_per_node", "1", "x.py"]))
port = int(args.rdzv_endpoint.rsplit(":", 1)[1])
check(not args.standalone and args.rdzv_backend == "c10d" and port != 29400
      and not low <= port <= high and args.rdzv_id,
      f"--standalone: own store ({args.rdzv_backend} at {args.rdzv_endpoint}, id {args.rdzv_id})")
# Two --standalone jobs at once: the second became a client of the first one's store on 29400,
# and when the first ended, the second's agent lost its store and killed its healthy worker
# ("RendezvousConnectionError ... Broken pipe", exit 1).
with tempfile.TemporaryDirectory() as d:
    worker = os.path.join(d, "w.py")
    with open(worker, "w") as f:
        f.write("import sys, time\ntime.sleep(float(sys.argv[1]))\n")
    launch = [sys.executable, "-m", "loom.torchrun", "--standalone", "--nproc_per_node", "1", worker]
    first = subprocess.Popen(launch + ["0.5"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(2.0)  # the first job's agent holds its store
    second = subprocess.Popen(launch + ["8"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rc = [p.wait(timeout=50) for p in (first, second)]
    err = second.stderr.read().decode(errors="replace")
    check(rc == [0, 0], f"two --standalone jobs at once: exit codes {rc}; second: {err[-300:]}")

# A real job: --redirects 3 sends both streams of every rank to its log files (it sent neither).
# Refused values end the launcher with one line before any worker starts.
with tempfile.TemporaryDirectory() as d:
    worker = os.path.join(d, "w.py")
    with open(worker, "w") as f:
        f.write("import os, sys\nprint('out of', os.environ['RANK'])\n"
                "print('err of', os.environ['RANK'], file=sys.stderr)\n")
    logs = os.path.join(d, "logs")
    launch = [sys.executable, "-m", "loom.torchrun", "--standalone", "--nproc_per_node", "2",
              "--monitor_interval", "0.2"]
    run = subprocess.run(launch + ["--redirects", "3", "--log_dir", logs, worker],
                         capture_output=True, text=True, timeout=50)
    check(run.returncode == 0, f"--redirects 3: exit {run.returncode}: {run.stderr[-300:]}")
    check("out of" not in run.stdout + run.stderr and "err of" not in run.stdout + run.stderr,
          "--redirects 3: nothing of the workers on the console")
    found = {}
    for root, _, files in os.walk(logs):
        for name in files:
            with open(os.path.join(root, name)) as f:
                found[(os.path.basename(root), name)] = f.read()
    for rank in (0, 1):
        for name, text in (("stdout.log", f"out of {rank}\n"), ("stderr.log", f"err of {rank}\n")):
            got = found.get((str(rank), name))
            check(got == text, f"--redirects 3: local rank {rank}'s {name} is {got!r}, want {text!r}")
    run = subprocess.run(launch + ["--redirects", "4", worker], capture_output=True, text=True,
                         timeout=50)
    lines = run.stderr.strip().splitlines()
    check(run.returncode != 0 and len(lines) == 1 and lines[0].startswith(
        "loom.torchrun: --redirects: '4' is not 0 (none), 1 (stdout), 2 (stderr), 3 (both)")
        and "out of" not in run.stdout, f"--redirects 4: exit {run.returncode}, {run.stderr!r}")

# Without --log_dir the agent made a torchelastic_* directory in TMPDIR for every job and left it
# (57 after a day of test runs here). The empty ones are now removed when the job ends; one
# holding redirected logs stays, and the launcher says where.
with tempfile.TemporaryDirectory() as d:
    worker = os.path.join(d, "w.py")
    with open(worker, "w") as f:
        f.write("print('out')\n")
    tmp = os.path.join(d, "tmp")
    os.mkdir(tmp)
    env = dict(os.environ, TMPDIR=tmp)
    launch = [sys.executable, "-m", "loom.torchrun", "--standalone", "--nproc_per_node", "1",
              "--monitor_interval", "0.2"]
    run = subprocess.run(launch + [worker], capture_output=True, text=True, timeout=50, env=env)
    left = os.listdir(tmp)
    check(run.returncode == 0 and left == [],
          f"no --log_dir: exit {run.returncode}, left in TMPDIR {left}: {run.stderr[-300:]}")
    run = subprocess.run(launch + ["--redirects", "1", worker], capture_output=True, text=True,
                         timeout=50, env=env)
    left = os.listdir(tmp)
    logs = [os.path.join(r, n) for r, _, names in os.walk(tmp) for n in names]
    check(run.returncode == 0 and len(left) == 1 and left[0].startswith("torchelastic_")
          and len(logs) == 1 and all(open(p).read() == "out\n" for p in logs)
          and f"loom.torchrun: the workers' logs are in {os.path.join(tmp, left[0])}" in run.stderr,
          f"--redirects 1, no --log_dir: exit {run.returncode}, left {left}, logs {logs}, "
          f"stderr {run.stderr[-300:]!r}")
    # The removal itself: empty directories go, a file and the directories above it stay.
    top = os.path.join(d, "t")
    os.makedirs(os.path.join(top, "a", "b"))
    os.makedirs(os.path.join(top, "c"))
    with open(os.path.join(top, "c", "keep"), "w") as f:
        f.write("x")
    check(not lr.remove_empty_dirs(top) and os.path.isfile(os.path.join(top, "c", "keep"))
          and not os.path.exists(os.path.join(top, "a")), "remove_empty_dirs keeps files")
    os.remove(os.path.join(top, "c", "keep"))
    check(lr.remove_empty_dirs(top) and not os.path.exists(top), "remove_empty_dirs removes all")

print(f"test_torchrun: {check.count} checks, {len(check.failures)} failed")
sys.exit(1 if check.failures else 0)
