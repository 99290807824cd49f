#!/usr/bin/python3
"""Checks the bad-input handling of the benchmark scripts and bench_comm (nothing is timed).

  bench_scripts_check.py BENCH_COMM WORKDIR

  - bench/torch_compare.py, bench/bench_torch_binding.py, bench/plan_validate.py and
    bench/train_validate.py: each out-of-range value, and a --json that cannot be written, is one
    line "<script>: ... (see --help)" and exit 2 before anything runs (they ran and printed 0.0
    GFLOP/s rows, or ended in a traceback, some after the whole run); plan_validate.py and
    train_validate.py remove their temporary directory even when a loom command fails;
  - bench/scaling.sh: the options it sets by default (--heads, --head-dim, --threads...) are
    replaced by the caller's (they were passed twice, and loom refused the run), and those it
    must set itself (--strategy, --json...) are refused in one line, exit 2; a stand-in loom
    records what it was given;
  - bench_comm: --ops with an unknown name, and a --max-bytes whose buffers cannot fit in memory,
    are one line and exit 1 before any op runs (--ops ring_step,foo ran the ring_step sweep
    first; --max-bytes 4T ended in a bare std::bad_alloc).
Needs no torch and no loom build (the scripts are refused before they would import or run them).
Exit 0 when all hold, else 1 with one line per failure.
"""
import json
import os
import signal
import stat
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")


def script(name):
    return os.path.normpath(os.path.join(BENCH, name))


def refused(cmd, needle, rc=2, env=None, timeout=60):
    """'' when cmd exits rc with one stderr line holding needle and nothing on stdout, else why
    not."""
    # Its own process group: a script that runs instead of refusing is stopped with its children.
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err_text = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return f"{' '.join(cmd)}: still running after {timeout} s (want a refusal)"
    err = err_text.strip().splitlines()
    if p.returncode != rc or len(err) != 1 or needle not in err[0] or out.strip():
        return (f"{' '.join(cmd)}: exit {p.returncode} (want {rc}), stdout {out[:300]!r}, "
                f"stderr {err_text[-600:]!r} (want one line naming '{needle}')")
    return ""


def check_python_scripts(work):
    bad = []
    py = sys.executable
    missing = os.path.join(work, "no-such-dir", "x.json")
    cases = {
        "torch_compare.py": [(["--seq", "0"], "--seq"), (["--heads", "0"], "--heads"),
                             (["--seq", "-5"], "--seq"), (["--dim", "0"], "--dim"),
                             (["--threads", "0"], "--threads"), (["--dtype", "fp16"], "--dtype"),
                             (["--reps", "0"], "--reps"), (["--gemm-n", "0"], "--gemm-n"),
                             (["--ring", "-3"], "--ring"), (["--json", missing], "--json"),
                             (["--json", work], "--json")],
        "bench_torch_binding.py": [(["--iters", "0"], "--iters"),
                                   (["--build", os.path.join(work, "no-such-build")], "--build"),
                                   (["--check-seq", "-1"], "--check-seq"),
                                   (["--tiny-iters", "3"], "--tiny-iters"),
                                   (["--heads", "3", "--kv-heads", "2"], "--kv-heads"),
                                   (["--json", missing], "--json")],
        "plan_validate.py": [(["--rounds", "0"], "--rounds"), (["--iters", "0"], "--iters"),
                             (["--loom", "/bin/false", "--json", missing], "--json"),
                             (["--loom", os.path.join(work, "no-such-loom")], "--loom")],
        "train_validate.py": [(["--rounds", "0"], "--rounds"), (["--steps", "2"], "--steps"),
                              (["--loom", "/bin/false", "--json", missing], "--json"),
                              (["--loom", os.path.join(work, "no-such-loom")], "--loom")],
    }
    for name, runs in cases.items():
        for args, needle in runs:
            why = refused([py, script(name)] + args, needle)
            if why:
                bad.append(why)
            elif needle == "--json" and os.path.exists(missing):
                bad.append(f"{name} {' '.join(args)}: wrote {missing}")
    # A loom command that fails: the scripts stop, and leave no temporary directory behind.
    for name in ("plan_validate.py", "train_validate.py"):
        tmp = os.path.join(work, "tmp-" + name)
        os.makedirs(tmp, exist_ok=True)
        for x in os.listdir(tmp):
            os.rmdir(os.path.join(tmp, x))
        r = subprocess.run([py, script(name), "--loom", "/bin/false", "--rounds", "1"],
                           capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, TMPDIR=tmp))
        if r.returncode == 0 or os.listdir(tmp):
            bad.append(f"{name} with a failing loom: exit {r.returncode}, left {os.listdir(tmp)} "
                       "in its TMPDIR")
    return bad


FAKE_LOOM = r"""#!/usr/bin/python3
# A stand-in for `loom attn`: refuses an option given twice (as CLI11 does), records its
# arguments and writes the report scaling.sh reads.
import json, sys
args = sys.argv[1:]
names = [a.split("=")[0] for a in args if a.startswith("--")]
dup = sorted(set(n for n in names if names.count(n) > 1))
if dup:
    sys.exit(f"{dup[0]}: At Most 1 required but received 2")
with open(sys.argv[0] + ".log", "a") as f:
    f.write(json.dumps(args) + "\n")
out = args[args.index("--json") + 1]
with open(out, "w") as f:
    json.dump(dict(forward_s=1.0, backward_s=2.0, efficiency=1.0, balance=1.0, overlap=0.0), f)
"""


def check_scaling(work):
    bad = []
    loom = os.path.join(work, "fake-loom")
    with open(loom, "w") as f:
        f.write(FAKE_LOOM)
    os.chmod(loom, os.stat(loom).st_mode | stat.S_IXUSR)
    log = loom + ".log"
    if os.path.exists(log):
        os.remove(log)
    env = dict(os.environ, OUT_DIR=os.path.join(work, "scaling-out"))
    sh = script("scaling.sh")
    r = subprocess.run(["bash", sh, loom, "2", "512", "--head-dim", "64", "--threads=2"],
                       capture_output=True, text=True, timeout=120, env=env)
    if r.returncode != 0:
        return [f"scaling.sh LOOM 2 512 --head-dim 64 --threads=2: exit {r.returncode}, "
                f"stderr {r.stderr!r}"]
    calls = [json.loads(x) for x in open(log)]
    if len(calls) != 9:
        bad.append(f"scaling.sh ran loom {len(calls)} times (want 9: 3 strategies x 3 layouts)")
    for c in calls:
        if (c[c.index("--head-dim") + 1] != "64" or "--threads=2" not in c
                or c[c.index("--heads") + 1] != "8" or c[c.index("--seq") + 1] != "512"):
            bad.append(f"scaling.sh gave loom {c} (want --head-dim 64 and --threads=2 in place "
                       "of the defaults, --heads 8 kept)")
            break
    for args, needle in ((["--strategy", "ring"], "--strategy"), (["--json", "x"], "--json"),
                         (["--seq", "64"], "--seq"), (["--ranks=4"], "--ranks")):
        why = refused(["bash", sh, loom, "2", "512"] + args, needle, env=env)
        if why:
            bad.append("scaling.sh: " + why)
    for pos, needle in ((["x", "512"], "P must be"), (["2", "0"], "S must be")):
        why = refused(["bash", sh, loom] + pos, needle, env=env)
        if why:
            bad.append("scaling.sh: " + why)
    return bad


def check_comm(comm):
    bad = []
    # The unknown op after a known one whose sizes cannot be allocated: refused before the known
    # op's sweep starts (it ran first, and here ended in std::bad_alloc).
    for args, needle in ((["--ops", "ring_step,foo"], "--ops: unknown op 'foo'"),
                         (["--ops", "ring_step,foo", "--min-bytes", "4T", "--max-bytes", "4T"],
                          "--ops: unknown op 'foo'"),
                         (["--min-bytes", "4T", "--max-bytes", "4T"], "--max-bytes 4T"),
                         (["--min-bytes", "2M", "--max-bytes", "1M"], "--min-bytes")):
        why = refused([comm, "--ranks", "2", "--iters", "1", "--warmup", "0"] + args, needle,
                      rc=1)
        if why:
            bad.append("bench_comm: " + why)
    return bad


def main():
    comm, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    bad = check_python_scripts(work) + check_scaling(work) + check_comm(comm)
    if bad:
        print("\n".join(bad))
        return 1
    print("bench scripts and bench_comm refuse bad input before running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
