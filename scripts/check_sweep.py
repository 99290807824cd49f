"""A random sweep of `loom attn --check`: random strategy, layout, ranks (1-8), S (1-700), heads and
kv heads, head dim (1-256), masks, windows, documents, bf16, threads and scales, each checked
against the fp64 reference. Prints every refusal (REFUSED, with its one-line reason) and every run
that neither passed nor was refused (BAD: a FAILED check, a crash, or `check cannot tell` where a
per-problem bound is 1 or more), then the counts; exit 1 if any was BAD.

Usage: /usr/bin/python3 scripts/check_sweep.py SEED SECONDS [LOOM]   (LOOM: build/loom)
"""
import os, random, subprocess, sys, time
random.seed(int(sys.argv[1]))
loom = sys.argv[3] if len(sys.argv) > 3 else os.path.join(os.path.dirname(__file__), "..", "build", "loom")
end = time.time() + float(sys.argv[2])
n = bad = 0
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
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    n += 1
    out = r.stdout + r.stderr
    if r.returncode == 0 and "check     passed" in out: continue
    if r.returncode == 1 and "loom: error:" in out and "check" not in out.split("loom: error:")[1][:20] and "non-finite" not in out:
        # a refusal: record the reason briefly
        print("REFUSED", " ".join(args[1:]), "::", out.strip().splitlines()[-1][:200], flush=True)
        continue
    bad += 1
    print("BAD rc=%d" % r.returncode, " ".join(args[1:]), "\n", out[-600:], flush=True)
print("runs", n, "bad", bad)
sys.exit(1 if bad else 0)
