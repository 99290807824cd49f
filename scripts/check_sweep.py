"""A random sweep of `loom attn --check`: random strategy, layout, ranks (1-8), S (1-700), heads and
kv heads, head dim (1-256), masks, windows, documents, bf16, threads and scales, each checked
against the fp64 reference. Prints every refusal (REFUSED, with its one-line reason) and every run
that neither passed nor was refused (BAD: a FAILED check, a crash, a timeout, a communication or
memory failure, a run past 300 s, or `check cannot tell` where a per-problem bound is 1 or more),
then the counts; exit 1 if any was BAD or none passed, 2 for a bad command line.

A refusal is exit 1 with one `loom: error:` line that is not a failure of the run itself: a line
naming a check, a non-finite result, a timeout, a rank that stopped, a failed communication or
memory is BAD (any exit 1 counted as a refusal, so a build that timed out on every run passed).

Usage: /usr/bin/python3 scripts/check_sweep.py SEED SECONDS [LOOM]   (LOOM: build/loom)
"""
import os, random, re, subprocess, sys, time

USAGE = "usage: /usr/bin/python3 scripts/check_sweep.py SEED SECONDS [LOOM]"


def refuse(why):
    print(f"check_sweep: {why}", file=sys.stderr)
    sys.exit(2)


if not 3 <= len(sys.argv) <= 4:
    refuse(USAGE)
try:
    random.seed(int(sys.argv[1]))
    seconds = float(sys.argv[2])
except ValueError:
    refuse(f"SEED must be an integer and SECONDS a number ({USAGE})")
if not seconds > 0 or seconds == float("inf"):
    refuse(f"SECONDS must be positive and finite, got {sys.argv[2]}")
loom = sys.argv[3] if len(sys.argv) > 3 else os.path.join(os.path.dirname(__file__), "..", "build", "loom")
if not (os.path.isfile(loom) and os.access(loom, os.X_OK)):
    refuse(f"{loom} is not an executable file (build first: scripts/run.sh)")
# Failures of the run, never refusals of its configuration (lower case).
NOT_A_REFUSAL = re.compile(r"^check|non-finite|timed out|timeout|stopped|died|out of memory|"
                           r"cannot allocate|mpi|communicat|internal|assert|signal|segmentation")
end = time.time() + seconds
n = bad = passed = 0
while time.time() < end:
    strat = random.choice(["ring", "ulysses", "hybrid", "allgather", "ring2d"])
    P = random.choice([1, 2, 3, 4, 6, 8])
    hkv = random.choice([1, 2, 3, 4, 6])
    g = random.choice([1, 2, 3])
    H = hkv * g
    D = random.choice([1, 3, 8, 16, 33, 64, 80, 128, 256])
    S = random.randint(1, 700)
    layout = random.choice(["zigzag", "stripe", "contiguous"])
    args = [loom, "attn", "--ranks", str(P), "--strategy", strat, "--layout", layout, "--seq", str(S),
            "--heads", str(H), "--kv-heads", str(hkv), "--head-dim", str(D), "--check", "--iters", "1",
            "--warmup", "0", "--quiet", "--seed", str(random.randint(0, 99999))]
    if random.random() < 0.5: args.append("--backward")
    if random.random() < 0.3: args.append("--no-causal")
    if random.random() < 0.3: args += ["--window", str(random.randint(1, S + 2))]
    if random.random() < 0.3:
        k = random.randint(1, min(S, 6)); cuts = sorted(random.sample(range(1, S), k - 1)) if S > 1 and k > 1 else []
        L = [b - a for a, b in zip([0] + cuts, cuts + [S])]
        args += ["--docs", ",".join(map(str, L))]
    if random.random() < 0.3: args += ["--dtype", "bf16"]
    if strat == "hybrid":
        u = random.choice([d for d in range(1, P + 1) if P % d == 0]); args += ["--ulysses", str(u)]
    if strat == "ring2d":
        i = random.choice([d for d in range(1, P + 1) if P % d == 0]); args += ["--inner", str(i)]
    if random.random() < 0.3: args += ["--threads", "2"]
    if random.random() < 0.2: args += ["--scale", str(random.choice([0.01, 0.5, 1.0, 2.0]))]
    n += 1
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        bad += 1
        print("BAD (past 300 s)", " ".join(args[1:]), flush=True)
        continue
    out = r.stdout + r.stderr
    if r.returncode == 0 and "check     passed" in out:
        passed += 1
        continue
    errors = [l.split("loom: error:", 1)[1].strip() for l in out.splitlines() if "loom: error:" in l]
    if r.returncode == 1 and len(errors) == 1 and not NOT_A_REFUSAL.search(errors[0].lower()):
        print("REFUSED", " ".join(args[1:]), "::", errors[0][:200], flush=True)
        continue
    bad += 1
    print("BAD rc=%d" % r.returncode, " ".join(args[1:]), "\n", out[-600:], flush=True)
print("runs", n, "passed", passed, "refused", n - passed - bad, "bad", bad)
if n and not passed:
    print("check_sweep: no run passed", file=sys.stderr)
sys.exit(1 if bad or not passed else 0)
