"""The PyTorch scripts' failure paths: examples/torch_cp_train.py and bench/bench_torch_binding.py.

- torch_cp_train.py: a run whose losses turn NaN (--lr 1e30) is a mismatch, exit 1, with one line
  naming the step (max(0.0, nan) is 0.0: NaN losses printed "match" and "every check matches",
  exit 0); a non-integer value is one line, exit 2 (argparse's usage, from every rank); a head
  dim above 256 is one line, exit 2 (the kernels' traceback at the first forward).
- bench_torch_binding.py --alternate at head dim 128: runs (the op it timed was built with the
  scale args.dim ** -0.5, one ulp off cp_attention's 1 / sqrt(D) for 52 head dims, so it was
  another cached op, which never ran: ZeroDivisionError); the timed cp_attention is checked
  first, backward included (a dk x 1.1 slipped in through sitecustomize fails it: one line,
  exit 1; it was timed unchecked); a failing 2-process worker's own error line reaches the
  parent's one line (its output was discarded: a bare CalledProcessError).

    PYTHONPATH=build/python /usr/bin/python3 tests/torch/test_scripts.py BUILD_DIR
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Checks  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
EXAMPLE = os.path.join(ROOT, "examples", "torch_cp_train.py")
BINDING = os.path.join(ROOT, "bench", "bench_torch_binding.py")
build = sys.argv[1]
check = Checks()

# Multiplies the gradient of cp_attention's k by 1.1 (the forward untouched), in the processes
# CORRUPT_DK names: "main" (no RANK: the script itself) or "worker" (the torchrun workers).
CORRUPT_DK = '''
import os
_where = os.environ.get("CORRUPT_DK")
if _where and ("RANK" in os.environ) == (_where == "worker"):
    import torch
    import loom.torch as _lt

    class _Grad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 1.1

    _orig = _lt.cp_attention
    _lt.cp_attention = lambda q, k, v, *a, **kw: _orig(q, _Grad.apply(k), v, *a, **kw)
'''


def run(cmd, env=None, timeout=120):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def one_line(r, rc, needle):
    lines = r.stderr.strip().splitlines()
    return r.returncode == rc and len(lines) == 1 and needle in lines[0]


with tempfile.TemporaryDirectory() as tmp:
    corpus = os.path.join(tmp, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("In the beginning God created the heaven and the earth.\n" * 40)
    example = [sys.executable, EXAMPLE, "--data", corpus, "--seq", "64", "--steps", "4"]

    r = run(example + ["--lr", "1e30"])
    check(r.returncode == 1 and "attention(1p): the loss at step 1 is nan (not finite" in r.stdout
          and "max relative difference of the losses: inf" in r.stdout
          and "MISMATCH: exit status 1" in r.stdout and "every check matches" not in r.stdout,
          f"torch_cp_train --lr 1e30 (NaN losses): exit {r.returncode} (want 1), stdout "
          f"{r.stdout[-800:]!r}, stderr {r.stderr[-400:]!r}")
    r = run(example + ["--lr", "1e30", "--no-check"])
    check(r.returncode == 1 and "the loss at step 1 is nan" in r.stdout,
          f"torch_cp_train --lr 1e30 --no-check: exit {r.returncode} (want 1), stdout "
          f"{r.stdout[-400:]!r}")
    r = run(example + ["--lr", "3e-3"])
    check(r.returncode == 0 and "every check matches" in r.stdout,
          f"torch_cp_train --lr 3e-3: exit {r.returncode} (want 0), stdout {r.stdout[-400:]!r}, "
          f"stderr {r.stderr[-400:]!r}")
    # --data that is not a regular file: a FIFO blocked in open() for ever, /dev/zero grew
    # without bound (3.5 GB in 6 s).
    fifo = os.path.join(tmp, "fifo")
    os.mkfifo(fifo)
    for args, needle in ((["--steps", "abc"], "--steps: invalid int value: 'abc'"),
                         (["--dim", "1024", "--heads", "2"], "head dim of 512"),
                         (["--data", fifo], f"cannot read --data {fifo}: not a regular file"),
                         (["--data", "/dev/zero"], "cannot read --data /dev/zero: not a regular"),
                         # without a launcher the cp options were ignored, exit 0
                         (["--ulysses", "2", "--strategy", "hybrid"],
                          "--strategy, --ulysses shape the context-parallel run, which needs a "
                          "launcher")):
        r = run(example + args)
        check(one_line(r, 2, needle) and not r.stdout,
              f"torch_cp_train {' '.join(args)}: exit {r.returncode} (want 2), stderr "
              f"{r.stderr[-400:]!r} (want one line naming {needle!r})")

    small = ["--seq", "64", "--heads", "2", "--kv-heads", "1", "--iters", "1", "--warmup", "0",
             "--check-seq", "32", "--build", build]
    r = run([sys.executable, BINDING, "--alternate", "1", "--dim", "128"] + small)
    check(r.returncode == 0 and "same call: Python wall time / engine time" in r.stdout,
          f"bench_torch_binding --alternate 1 --dim 128: exit {r.returncode} (want 0), stdout "
          f"{r.stdout[-400:]!r}, stderr {r.stderr[-600:]!r}")

    site = os.path.join(tmp, "site")
    os.makedirs(site)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(CORRUPT_DK)
    path = site + os.pathsep + os.environ.get("PYTHONPATH", "")
    r = run([sys.executable, BINDING, "--alternate", "1", "--dim", "16"] + small,
            env={"PYTHONPATH": path, "CORRUPT_DK": "main"})
    check(one_line(r, 1, "bench_torch_binding.py: cp_attention over a 1-rank group: dk is off "
                         "loom's fp64 reference by 0.1") and "ratio" not in r.stdout,
          f"bench_torch_binding --alternate with dk x 1.1: exit {r.returncode} (want 1), stdout "
          f"{r.stdout[-400:]!r}, stderr {r.stderr[-600:]!r}")

    # The whole run, up to its 2-process part, whose workers' check fails. A stand-in mpirun on
    # PATH passes the up-front check and fails if it is ever reached.
    bindir = os.path.join(tmp, "bin")
    os.makedirs(bindir)
    with open(os.path.join(bindir, "mpirun"), "w") as f:
        f.write("#!/bin/sh\necho 'stand-in mpirun: not to be reached' >&2\nexit 1\n")
    os.chmod(os.path.join(bindir, "mpirun"), 0o755)
    r = run([sys.executable, BINDING, "--dim", "16", "--tiny-iters", "4"] + small,
            env={"PYTHONPATH": path, "CORRUPT_DK": "worker",
                 "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}, timeout=240)
    check(one_line(r, 1, "the 2-process cp_attention run (loom.torchrun) failed (exit status 1): "
                         "bench_torch_binding.py: cp_attention over 2 processes: dk is off"),
          f"bench_torch_binding with the workers' dk x 1.1: exit {r.returncode} (want 1), stderr "
          f"{r.stderr[-800:]!r} (want one line with the worker's own error)")

print(f"test_scripts: {check.count} checks, {len(check.failures)} failed")
sys.exit(1 if check.failures else 0)
