#!/usr/bin/python3
"""Checks the bad-input handling of the benchmark scripts and bench_comm (nothing is timed).

  bench_scripts_check.py BENCH_COMM WORKDIR

  - bench/torch_compare.py, bench/bench_torch_binding.py, bench/plan_validate.py and
    bench/train_validate.py: each out-of-range value, and a --json that cannot be written, is one
    line "<script>: ... (see --help)" and exit 2 before anything runs (they ran and printed 0.0
    GFLOP/s rows, or ended in a traceback, some after the whole run); plan_validate.py and
    train_validate.py remove their temporary directory even when a loom command fails;
  - torch_compare.py: a --threads beyond 4 x the CPUs, and a --seq or --gemm-n whose tensors
    cannot fit in memory, refused so (--threads 100000 crashed the child and the parent said
    nothing, exit 245; a huge --seq or --gemm-n was a RuntimeError traceback); a child killed by a
    signal is one line naming it, exit 1;
  - plan_validate.py and train_validate.py: a --json that names --loom (the same path, a
    symlink, a hard link, or "-" with standard output on it) or train_validate's --data is refused
    (the report replaced the loom command); a --loom that exits 0 without writing its report
    (/bin/true) is one line, exit 1 (a FileNotFoundError traceback); train_validate.py passes
    --data to loom train (run from outside the repository, loom's default data/kjv.txt was
    missing after the first calibration) and refuses a missing one first;
  - their --json by loom's rules (docs/cli.md, "Files"; bench/validate_common.py): "-" is
    standard output with the text on standard error, /dev/stdout into a pipe or appended to a
    file is written there (it was refused: "cannot write in /proc/NNN/fd"), /dev/null and a FIFO
    with a reader in place (refused: "is not a regular file"), a FIFO with none and /dev/full one
    line and exit 1, a regular file atomically keeping its permission bits, a directory, a
    missing directory or a closed descriptor refused before the run; plan_validate.py and
    train_validate.py run end to end on a stand-in loom named by --loom loom, found on PATH (it
    was refused: "not an executable file"), with --json -, /dev/stdout and /dev/null;
  - bench/scaling.sh: the options it sets by default (--heads, --head-dim, --threads...) are
    replaced by the caller's (they were passed twice, and loom refused the run), and those it
    must set itself (--strategy, --json...) are refused in one line, exit 2; every strategy runs
    in every layout, hybrid and ring2d where P has a divisor strictly between 1 and P (ring2d
    never ran, hybrid in zigzag only), --ulysses U and --inner I setting their degree (refused as
    "set by the script", which set neither), a degree that does not divide P refused; ulysses
    and hybrid where their degree does not split the heads read "not run: <why>" and the sweep
    goes on (at P = 3 it stopped at ulysses, exit 1, allgather never ran); a stand-in loom
    records what it was given; --help and -h are refused, a loom that exits 0 without writing
    its report is one line, exit 1 (the previous sweep's report was printed as the row), and one
    that refuses the options at the first run gives its line alone (no table header), exit 2;
  - scripts/check_sweep.py: a run counts as refused only for a refusal of its configuration (any
    exit 1 did: a loom that timed out on every run passed the sweep), a sweep where no run passed
    is exit 1, and a bad command line is one line, exit 2 (tracebacks);
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
                             (["--json", work], "--json"),
                             # far past 4 x any machine's CPUs and any machine's memory
                             (["--threads", "1", "100000"], "--threads 100000: at most"),
                             (["--gemm-n", "1000000"], "--gemm-n 1000000: needs about"),
                             (["--seq", "1000000"], "--seq 1000000: needs about"),
                             (["--ring", "1000000"], "--ring 1000000: needs about")],
        "bench_torch_binding.py": [(["--iters", "0"], "--iters"),
                                   (["--build", os.path.join(work, "no-such-build")], "--build"),
                                   (["--check-seq", "-1"], "--check-seq"),
                                   (["--tiny-iters", "3"], "--tiny-iters"),
                                   (["--heads", "3", "--kv-heads", "2"], "--kv-heads"),
                                   # a traceback after part 1 had run
                                   (["--dim", "300"], "--dim 300: loom's kernels take a head "
                                                      "dim of at most 256"),
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
    # A torch_compare.py child killed by a signal (here at its start, before torch loads): one
    # line naming the signal, exit 1 (it was silent, exit status 245 for SIGSEGV).
    site = os.path.join(work, "segv-site")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write("import os, signal, sys\nif '--child' in sys.argv:\n"
                "    os.kill(os.getpid(), signal.SIGSEGV)\n")
    env = dict(os.environ, PYTHONPATH=site + os.pathsep + os.environ.get("PYTHONPATH", ""))
    why = refused([py, script("torch_compare.py"), "--seq", "8", "--threads", "1"],
                  "killed by SIGSEGV", rc=1, env=env)
    if why:
        bad.append(why)
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


# Drives bench/validate_common.py's --json handling: check_output (before the "run"), a line of
# text, write_json.
JSON_DRIVER = r"""
import sys
sys.path.insert(0, sys.argv[1])
import validate_common as v
ap = v.ArgumentParser(prog="driver")
v.check_output(ap, sys.argv[2])
print("text of the run", flush=True)
v.write_json(sys.argv[2], {"ok": 1})
"""


def check_json_outputs(work):
    """validate_common's --json: every kind of output the scripts share, as loom writes them."""
    bad = []
    py = sys.executable

    def drive(path, **kw):
        return subprocess.run([py, "-c", JSON_DRIVER, BENCH, path], text=True, timeout=60, **kw)

    # "-": the JSON alone on standard output, the text on standard error (it wrote a file "-").
    r = drive("-", capture_output=True, cwd=work)
    if r.returncode != 0 or r.stdout != '{\n  "ok": 1\n}\n' or "text of the run" not in r.stderr \
            or os.path.exists(os.path.join(work, "-")):
        bad.append(f"--json -: exit {r.returncode}, stdout {r.stdout!r}, stderr {r.stderr!r}")
    # /dev/stdout into a pipe: written there, after the text.
    r = drive("/dev/stdout", capture_output=True)
    if r.returncode != 0 or not r.stdout.startswith("text of the run\n{") or r.stderr:
        bad.append(f"--json /dev/stdout into a pipe: exit {r.returncode}, stdout {r.stdout!r}, "
                   f"stderr {r.stderr!r}")
    # /dev/stdout appended to a file: the file's lines kept, the JSON after them (never replaced).
    log = os.path.join(work, "append.log")
    with open(log, "w") as f:
        f.write("earlier\n")
    with open(log, "a") as f:
        r = drive("/dev/stdout", stdout=f, stderr=subprocess.PIPE)
    text = open(log).read()
    if r.returncode != 0 or not text.startswith("earlier\ntext of the run\n{"):
        bad.append(f"--json /dev/stdout >> file: exit {r.returncode}, the file holds {text!r}")
    # /dev/null: written in place, still a device.
    r = drive("/dev/null", capture_output=True)
    if r.returncode != 0 or r.stderr or not stat.S_ISCHR(os.stat("/dev/null").st_mode):
        bad.append(f"--json /dev/null: exit {r.returncode}, stderr {r.stderr!r}")
    # A FIFO with a reader: written in place; without one, one line and exit 1, no wait.
    fifo = os.path.join(work, "json-fifo")
    if os.path.exists(fifo):
        os.remove(fifo)
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", fifo], stdout=subprocess.PIPE, text=True)
    r = drive(fifo, capture_output=True)
    try:  # a writer's end for the reader, should the script not have opened one
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass
    try:
        got = reader.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        reader.kill()
        got = reader.communicate()[0]
    try:
        read = json.loads(got)
    except ValueError:
        read = None
    if r.returncode != 0 or read != {"ok": 1}:
        bad.append(f"--json FIFO with a reader: exit {r.returncode}, stderr {r.stderr!r}, the "
                   f"reader got {got!r}")
    try:
        r = drive(fifo, capture_output=True)
        err = r.stderr.strip().splitlines()
        if r.returncode != 1 or len(err) != 1 or "nobody reads" not in err[0]:
            bad.append(f"--json FIFO with no reader: exit {r.returncode}, stderr {r.stderr!r}")
    except subprocess.TimeoutExpired:
        bad.append("--json FIFO with no reader: still waiting after 60 s")
    if not stat.S_ISFIFO(os.stat(fifo).st_mode):
        bad.append("--json FIFO: the FIFO was replaced")
    # /dev/full: one line, exit 1 (no traceback).
    r = drive("/dev/full", capture_output=True)
    err = r.stderr.strip().splitlines()
    if r.returncode != 1 or len(err) != 1 or "/dev/full: write failed" not in err[0]:
        bad.append(f"--json /dev/full: exit {r.returncode}, stderr {r.stderr!r}")
    # A regular file: replaced whole, its permission bits kept, no temporary left.
    reg = os.path.join(work, "reg.json")
    with open(reg, "w") as f:
        f.write("old")
    os.chmod(reg, 0o600)
    r = drive(reg, capture_output=True)
    if r.returncode != 0 or json.load(open(reg)) != {"ok": 1} or \
            stat.S_IMODE(os.stat(reg).st_mode) != 0o600 or \
            [x for x in os.listdir(work) if x.startswith("reg.json.")]:
        bad.append(f"--json regular file: exit {r.returncode}, mode "
                   f"{oct(stat.S_IMODE(os.stat(reg).st_mode))}, {os.listdir(work)}")
    # Refused before the run: one line, exit 2, nothing printed.
    for path, needle in ((work, "is a directory"),
                         (os.path.join(work, "no-such-dir", "x.json"), "no directory"),
                         ("/dev/fd/9", "descriptor 9 is not open")):
        r = drive(path, capture_output=True)
        err = r.stderr.strip().splitlines()
        if r.returncode != 2 or len(err) != 1 or needle not in err[0] or r.stdout:
            bad.append(f"--json {path}: exit {r.returncode}, stdout {r.stdout!r}, stderr "
                       f"{r.stderr!r} (want one line naming '{needle}', exit 2)")
    return bad


# A stand-in for the loom commands plan_validate.py and train_validate.py run: each writes what
# the script reads, every prediction equal to its measurement.
FAKE_PLAN_LOOM = r"""#!/usr/bin/python3
import json, os, sys
a = sys.argv[1:]
def after(opt):
    return a[a.index(opt) + 1]
if a[:2] == ["plan", "--calibrate"]:
    json.dump({"speed": 1.0}, open(a[2], "w"))
elif a[0] == "attn":
    json.dump({"forward_times_s": [0.25], "backward_times_s": [0.5]}, open(after("--json"), "w"))
elif a[:2] == ["plan", "--simulate"]:
    json.dump({"forward_s": 0.25, "backward_s": 0.5}, open(after("--json"), "w"))
elif a[:2] == ["plan", "--train-step"]:
    json.dump({"one_rank": {}, "meshes": [{"step_s": 0.5}] * a.count("--mesh")},
              open(after("--json"), "w"))
elif a[0] == "train":
    # As loom train: --data (default data/kjv.txt, relative to the current directory) must exist.
    data = after("--data") if "--data" in a else "data/kjv.txt"
    if not os.path.isfile(data):
        sys.exit(f"loom: error: --data {data}: no such file")
    with open(after("--log"), "w") as f:
        for _ in range(int(after("--steps"))):
            f.write(json.dumps({"seconds": 0.5}) + "\n")
else:
    sys.exit("fake loom: unexpected " + " ".join(a))
"""


def check_loom_scripts(work):
    """plan_validate.py and train_validate.py end to end on a stand-in loom: --loom loom found on
    PATH, and their --json on standard output, /dev/stdout into a pipe and /dev/null."""
    bad = []
    bindir = os.path.join(work, "bin")
    os.makedirs(bindir, exist_ok=True)
    loom = os.path.join(bindir, "loom")
    with open(loom, "w") as f:
        f.write(FAKE_PLAN_LOOM)
    os.chmod(loom, 0o755)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    corpus = os.path.join(work, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("In the beginning\n" * 64)
    for name in ("plan_validate.py", "train_validate.py"):
        # cwd=work below: loom train's default data/kjv.txt is not there, the --data given is.
        extra = (["--steps", "3", "--data", corpus] if name == "train_validate.py"
                 else ["--iters", "1"])
        cmd = [sys.executable, script(name), "--loom", "loom", "--rounds", "1"] + extra
        r = subprocess.run(cmd + ["--json", "-"], capture_output=True, text=True, timeout=120,
                           env=env, cwd=work)
        try:
            doc = json.loads(r.stdout)
        except ValueError:
            doc = None
        if r.returncode != 0 or not isinstance(doc, dict) or "PASS" not in r.stderr or \
                os.path.exists(os.path.join(work, "-")):
            bad.append(f"{name} --loom loom --json -: exit {r.returncode}, stdout "
                       f"{r.stdout[:300]!r}, stderr {r.stderr[-600:]!r} (want the JSON alone on "
                       "stdout, the table on stderr)")
            continue
        # /dev/stdout into a pipe (`| cat`): the table, then the JSON.
        r = subprocess.run(cmd + ["--json", "/dev/stdout"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=120, env=env)
        if r.returncode != 0 or "PASS" not in r.stdout or not r.stdout.rstrip().endswith("}"):
            bad.append(f"{name} --json /dev/stdout | cat: exit {r.returncode}, stdout "
                       f"{r.stdout[-300:]!r}, stderr {r.stderr!r}")
        r = subprocess.run(cmd + ["--json", "/dev/null"], capture_output=True, text=True,
                           timeout=120, env=env)
        if r.returncode != 0 or not stat.S_ISCHR(os.stat("/dev/null").st_mode):
            bad.append(f"{name} --json /dev/null: exit {r.returncode}, stderr {r.stderr!r}")
    why = refused([sys.executable, script("plan_validate.py"), "--loom", "no-such-loom-cmd"],
                  "nor a command on PATH", env=env)
    if why:
        bad.append(why)
    bad += check_inputs_kept(work, loom, corpus, env)
    return bad


def check_inputs_kept(work, loom, corpus, env):
    """--json naming an input is refused, whatever the name, and the input is left as it was;
    a --loom that writes no report, and a missing --data, are one line each."""
    bad = []
    link = os.path.join(work, "loom-symlink")
    hard = os.path.join(work, "loom-hardlink")
    for p in (link, hard):
        if os.path.lexists(p):
            os.remove(p)
    os.symlink(loom, link)
    os.link(loom, hard)
    before = open(loom).read()
    for name in ("plan_validate.py", "train_validate.py"):
        base = [sys.executable, script(name), "--rounds", "1"]
        if name == "train_validate.py":
            base += ["--steps", "3", "--data", corpus]
        cases = [(["--loom", loom, "--json", loom], "name the same file"),
                 (["--loom", "loom", "--json", loom], "name the same file"),  # found on PATH
                 (["--loom", loom, "--json", link], "name the same file"),
                 (["--loom", link, "--json", hard], "name the same file")]
        if name == "train_validate.py":
            cases += [(["--loom", loom, "--json", corpus], "--data"),
                      (["--loom", loom, "--data", os.path.join(work, "no-such-corpus")],
                       "no readable file")]
        for args, needle in cases:
            why = refused(base + args, needle, env=env)
            if why:
                bad.append(why)
        # "-" with standard output appended to the loom command (appended: the shell's ">" would
        # have emptied it before the script ran).
        with open(loom, "a") as out:
            r = subprocess.run(base + ["--loom", loom, "--json", "-"], stdout=out,
                               stderr=subprocess.PIPE, text=True, timeout=120, env=env)
        err = r.stderr.strip().splitlines()
        if r.returncode != 2 or len(err) != 1 or "name the same file" not in err[0]:
            bad.append(f"{name} --json - >> LOOM: exit {r.returncode}, stderr {r.stderr!r} (want "
                       "one line: --json - and --loom name the same file, exit 2)")
        if open(loom).read() != before:
            bad.append(f"{name}: the --loom file was changed by a --json naming it")
            with open(loom, "w") as f:
                f.write(before)
        # A command that exits 0 and writes nothing: one line naming it, exit 1.
        why = refused(base + ["--loom", "/bin/true"], "is not its report", rc=1, env=env)
        if why:
            bad.append(why)
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
    if "hybrid, ring2d: not run (P = 2" not in r.stdout:
        bad.append(f"scaling.sh at P = 2 does not say hybrid and ring2d were not run: {r.stdout!r}")
    # P = 4: every strategy in every layout, hybrid with --ulysses 2 and ring2d with --inner 2
    # only (ring2d never ran; hybrid ran in zigzag only); P = 6 with --ulysses 3: hybrid at 3,
    # ring2d at the default 2 (12 heads: ulysses splits them over 6 ranks, hybrid over 3).
    for P, opts, degrees in (("4", [], {"hybrid": "2", "ring2d": "2"}),
                             ("4", ["--inner=2"], {"hybrid": "2", "ring2d": "2"}),
                             ("6", ["--ulysses", "3", "--heads", "12"],
                              {"hybrid": "3", "ring2d": "2"})):
        if os.path.exists(log):
            os.remove(log)
        r = subprocess.run(["bash", sh, loom, P, "512"] + opts, capture_output=True, text=True,
                           timeout=120, env=env)
        calls = [json.loads(x) for x in open(log)] if os.path.exists(log) else []
        runs = sorted((c[c.index("--strategy") + 1], c[c.index("--layout") + 1]) for c in calls)
        want = sorted((s, lay) for s in ("ring", "ulysses", "allgather", "hybrid", "ring2d")
                      for lay in ("zigzag", "contiguous", "stripe"))
        what = f"scaling.sh LOOM {P} 512 {' '.join(opts)}"
        if r.returncode != 0 or runs != want:
            bad.append(f"{what}: exit {r.returncode}, ran {runs} (want every strategy in every "
                       f"layout), stderr {r.stderr!r}")
            continue
        for c in calls:
            strat = c[c.index("--strategy") + 1]
            got = {o: c[c.index(o) + 1] for o in ("--ulysses", "--inner") if o in c}
            want_deg = {"hybrid": {"--ulysses": degrees["hybrid"]},
                        "ring2d": {"--inner": degrees["ring2d"]}}.get(strat, {})
            if got != want_deg or c[c.index("--ranks") + 1] != P:
                bad.append(f"{what}: {strat} ran with {got} (want {want_deg}), ranks "
                           f"{c[c.index('--ranks') + 1]}")
                break
    # Where the Ulysses degree does not split the heads: those rows say why, the rest run, and
    # the sweep ends with its reports line, exit 0 (at P = 3 it stopped at ulysses).
    for P, opts, skipped, why in (
            ("3", [], {"ulysses"}, "heads (8) must be divisible by the ulysses degree (3)"),
            ("4", ["--heads=12", "--kv-heads", "6"], {"ulysses"},
             "kv-heads (6) and the ulysses degree (4) must divide one another"),
            ("6", ["--heads", "3", "--kv-heads", "3"], {"ulysses", "hybrid"}, None)):
        if os.path.exists(log):
            os.remove(log)
        r = subprocess.run(["bash", sh, loom, P, "512"] + opts, capture_output=True, text=True,
                           timeout=120, env=env)
        calls = [json.loads(x) for x in open(log)] if os.path.exists(log) else []
        ran = {c[c.index("--strategy") + 1] for c in calls}
        strategies = {"ring", "ulysses", "allgather"}
        if P != "3":
            strategies |= {"hybrid", "ring2d"}
        lines = [x for x in r.stdout.splitlines() if "not run: " in x and "hybrid, ring2d" not in x]
        what = f"scaling.sh LOOM {P} 512 {' '.join(opts)}"
        if (r.returncode != 0 or ran != strategies - skipped or len(calls) != 3 * len(ran)
                or len(lines) != 3 * len(skipped) or "reports: " not in r.stdout
                or (why and not all(x.endswith("not run: " + why) for x in lines))):
            bad.append(f"{what}: exit {r.returncode}, ran {sorted(ran)} in {len(calls)} runs "
                       f"(want {sorted(strategies - skipped)}, 3 layouts each), stdout "
                       f"{r.stdout!r}, stderr {r.stderr!r} (want {3 * len(skipped)} 'not run: "
                       f"{why or '...'}' lines and the reports line)")
    for P, args, needle in (("2", ["--strategy", "ring"], "--strategy"),
                            ("2", ["--json", "x"], "--json"),
                            ("2", ["--seq", "64"], "--seq"), ("2", ["--ranks=4"], "--ranks"),
                            ("2", ["--ulysses", "2"], "--ulysses '2' must divide P = 2"),
                            ("4", ["--inner", "4"], "--inner '4' must divide P = 4"),
                            ("4", ["--inner", "1"], "--inner '1' must divide P = 4"),
                            ("6", ["--inner=4"], "--inner '4' must divide P = 6"),
                            ("4", ["--inner"], "--inner needs a value"),
                            ("2", ["--help"], "--help is not for a sweep"),
                            ("2", ["-h"], "-h is not for a sweep")):
        why = refused(["bash", sh, loom, P, "512"] + args, needle, env=env)
        if why:
            bad.append("scaling.sh: " + why)
    for pos, needle in ((["x", "512"], "P must be"), (["2", "0"], "S must be")):
        why = refused(["bash", sh, loom] + pos, needle, env=env)
        if why:
            bad.append("scaling.sh: " + why)
    # A loom that exits 0 without writing its report (loom attn --help, passed through, did): the
    # previous sweep's report in OUT_DIR was printed as this run's row, exit 0. And one that
    # refuses the options (exit 2) at the first run: its line alone, exit 2, no table header.
    for rc, want_rc, needle in ((0, 1, "exited 0 without writing its report"), (2, 2, None)):
        silent = os.path.join(work, f"silent-loom-{rc}")
        with open(silent, "w") as f:
            f.write(f"#!/bin/sh\n[ {rc} = 2 ] && echo 'loom: error: bad option' >&2\nexit {rc}\n")
        os.chmod(silent, 0o755)
        r = subprocess.run(["bash", sh, silent, "2", "512"], capture_output=True, text=True,
                           timeout=120, env=env)  # env's OUT_DIR holds the first sweep's reports
        if (r.returncode != want_rc or r.stdout or (needle and needle not in r.stderr)
                or len(r.stderr.splitlines()) != 1):
            bad.append(f"scaling.sh with a loom that exits {rc} writing nothing: exit "
                       f"{r.returncode} (want {want_rc}), stdout {r.stdout!r} (want none), "
                       f"stderr {r.stderr!r} (want one line{', ' + repr(needle) if needle else ''})")
    return bad


def check_sweep(work):
    """scripts/check_sweep.py on stand-in loom commands: only a refusal of the configuration
    counts as one (any exit 1 did: a loom that timed out on every run passed), a run that passes
    nothing is exit 1, and a bad command line one line, exit 2 (tracebacks)."""
    bad = []
    sweep = os.path.normpath(os.path.join(BENCH, "..", "scripts", "check_sweep.py"))
    stand_ins = {
        "timeout": ("echo 'loom: error: ring step 3: timed out after 60 s waiting for rank 1' >&2",
                    1, 1),
        "oom": ("echo 'loom: error: out of memory for the kernels workspace' >&2", 1, 1),
        "refuses": ("echo 'loom: error: hybrid: heads (2) must be divisible by the ulysses "
                    "degree (4)' >&2", 1, 1),
        "passes": ("echo '  check     passed  max abs err 1e-07'", 0, 0)}
    for name, (line, code, want) in stand_ins.items():
        fake = os.path.join(work, f"sweep-loom-{name}")
        with open(fake, "w") as f:
            f.write(f"#!/bin/sh\n{line}\nexit {code}\n")
        os.chmod(fake, 0o755)
        r = subprocess.run([sys.executable, sweep, "1", "0.5", fake], capture_output=True,
                           text=True, timeout=60)
        tail = r.stdout.strip().splitlines()[-1:] or [""]
        counts = dict(zip(tail[0].split()[0::2], tail[0].split()[1::2]))
        kind = {"timeout": "bad", "oom": "bad", "refuses": "refused", "passes": "passed"}[name]
        if r.returncode != want or counts.get(kind) != counts.get("runs") or counts.get("runs") in (None, "0"):
            bad.append(f"check_sweep.py on a loom that {name}: exit {r.returncode} (want {want}), "
                       f"last line {tail[0]!r} (want every run counted {kind})")
    for args, needle in (([], "usage:"), (["x", "1"], "SEED must be an integer"),
                         (["1", "1", os.path.join(work, "no-such-loom")], "not an executable file")):
        why = refused([sys.executable, sweep] + args, needle)
        if why:
            bad.append("check_sweep.py: " + why)
    return bad


def check_comm(comm):
    bad = []
    # The unknown op after a known one whose sizes cannot be allocated: refused before the known
    # op's sweep starts (it ran first, and here ended in std::bad_alloc).
    # A bad value is a bad command line, exit 2 (--ops foo and --min-bytes -1 were 1, a failed
    # run's status); buffers that do not fit the machine, exit 1.
    for args, needle, rc in ((["--ops", "ring_step,foo"], "--ops: unknown op 'foo'", 2),
                             (["--ops", "ring_step,foo", "--min-bytes", "4T", "--max-bytes", "4T"],
                              "--ops: unknown op 'foo'", 2),
                             (["--min-bytes", "4T", "--max-bytes", "4T"], "--max-bytes 4T", 1),
                             (["--min-bytes", "2M", "--max-bytes", "1M"], "--min-bytes", 2),
                             (["--min-bytes", "-1"], "--min-bytes", 2),
                             (["--max-bytes", "16Z"], "--max-bytes", 2)):
        why = refused([comm, "--ranks", "2", "--iters", "1", "--warmup", "0"] + args, needle,
                      rc=rc)
        if why:
            bad.append("bench_comm: " + why)
    # --json -: the JSON alone on standard output, the table on standard error (both went to
    # standard output, unparseable).
    p = subprocess.run([comm, "--ranks", "2", "--ops", "all_reduce", "--min-bytes", "1K",
                        "--max-bytes", "1K", "--iters", "1", "--warmup", "0", "--json", "-"],
                       capture_output=True, text=True, timeout=60)
    try:
        doc = json.loads(p.stdout)
        ok = p.returncode == 0 and doc["results"] and "all_reduce" in p.stderr
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        bad.append(f"bench_comm --json -: exit {p.returncode}, stdout {p.stdout[:300]!r}, "
                   f"stderr {p.stderr[-300:]!r} (want the JSON alone on stdout)")
    return bad


def main():
    comm, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    bad = (check_python_scripts(work) + check_json_outputs(work) + check_loom_scripts(work) +
           check_scaling(work) + check_sweep(work) + check_comm(comm))
    if bad:
        print("\n".join(bad))
        return 1
    print("bench scripts and bench_comm refuse bad input before running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
