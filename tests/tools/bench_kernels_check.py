#!/usr/bin/python3
"""Checks bench_kernels' target lines against its own rows (a tiny sweep; no timing is judged).

  bench_kernels_check.py BENCH_KERNELS WORKDIR

Runs BENCH_KERNELS on S = 256, D = 128 and 64 (in that order: the D = 64 / D = 128 line once
divided by the last --dim), fp32 and bf16, with a ring-step row, on the path the CPU picks and,
where that is an AVX-512 path, again with LOOM_KERNEL=avx2 (issue 10 sets one list of targets for
AVX-512 paths and another for AVX2 and the rest: both lists are checked where the CPU runs both),
and checks from each run's --json that
  - every row has at least 5 timed calls of each kernel with an sgemm window before and after
    each, its GFLOP/s is its fastest call's, each kernel's sgemm rate is the fastest of its own
    windows and its ratio is its rate over that (the row's gemm_gflops: the fastest of all);
  - each target's value is what its rows give: the sgemm lines the D = 128 row's ratios, the
    row-over-row lines the quotient of the two rows' ratios, in the right order;
  - the sgemm lines appear for D = 128 only, and the D = 64 / D = 128 line appears once per kind;
  - each line carries its path's goal, and a path shows only its own list's lines;
  - "met" is value >= target;
and that --heads not a multiple of --kv-heads, and each out-of-range value, is one error line
and a non-zero exit before anything runs.
Then --thread-scaling (rounds of 1-thread and 2-thread calls beside sgemm windows of both counts):
that each kernel of each dtype has its rounds with positive times and windows, that its medians
are the medians of the rounds' t1 / t2, g2 / g1 and their quotient, that the two-thread target
lines (on non-AVX-512 paths; none on AVX-512 ones) carry loom's median, 1.85 and the right
verdict, and that --threads 1, --thread-scaling 0 and --cpu-time beside it are refused with a
non-zero exit.
Exit 0 when all hold, else 1 with one line per failure.
"""
import json
import math
import os
import subprocess
import sys


AVX512_CORES = ("SkylakeX", "Cooperlake", "SapphireRapids")


def is_avx512_path(path):
    """The paths issue 10's AVX-512 list applies to: avx512, avx512bf16 and amx (the avx512 table
    with bf16 GEMMs on AMX tiles)."""
    return path.startswith("avx512") or path == "amx"


def check_run(bench, work, kernel):
    """Runs the sweep with LOOM_KERNEL=kernel (None: unset); returns (path, failures)."""
    out = os.path.join(work, f"bench-{kernel or 'auto'}.json")
    cmd = [bench, "--seq", "256", "--dim", "128", "64", "--dtype", "fp32", "bf16", "--ring", "128",
           "--threads", "1", "--min-time", "0.01", "--heads", "2", "--kv-heads", "2",
           "--gemm-n", "128", "--no-torch", "--json", out]
    env = {k: v for k, v in os.environ.items() if k not in ("LOOM_KERNEL", "OPENBLAS_CORETYPE")}
    if kernel:
        env["LOOM_KERNEL"] = kernel
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if r.returncode != 0:
        return kernel, [f"bench_kernels (LOOM_KERNEL={kernel}) exited {r.returncode}:\n"
                        f"{r.stdout}\n{r.stderr}"]
    doc = json.load(open(out))
    rows, targets, path = doc["results"], doc["targets"], doc["kernel_path"]
    avx512 = is_avx512_path(path)
    bad = []

    def row(dtype, sq, dim, causal):
        for x in rows:
            if (x["dtype"], x["seq_q"], x["dim"], x["causal"], x["threads"]) == (dtype, sq, dim,
                                                                                  causal, 1):
                return x
        bad.append(f"no row {dtype} {sq} D={dim} causal={causal}")
        return None

    for x in rows:
        fwd_flops = 4.0 * x["dim"] * x["visible_pairs"]
        windows = []
        for k, flops in (("fwd", fwd_flops), ("bwd", 2.5 * fwd_flops)):
            calls, gemm = x[f"{k}_calls_s"], x[f"{k}_sgemm"]
            windows += gemm
            if len(calls) < 5 or len(gemm) != len(calls) + 1 or min(gemm) <= 0 or min(calls) <= 0:
                bad.append(f"{k}: want >= 5 calls and a positive window beside each: {x}")
                continue
            if not math.isclose(x[f"{k}_gflops"], flops / min(calls) * 1e-9, rel_tol=1e-9):
                bad.append(f"{k}_gflops is not the fastest call's rate: {x}")
            # Each kernel's ratio is over the fastest window among its own calls, not the row's.
            if not math.isclose(x[f"{k}_gemm_gflops"], max(gemm), rel_tol=1e-9):
                bad.append(f"{k}_gemm_gflops is not the fastest of {k}'s windows: {x}")
            if not math.isclose(x[f"{k}_ratio"], x[f"{k}_gflops"] / max(gemm), rel_tol=1e-9):
                bad.append(f"{k}_ratio is not {k}_gflops over {k}'s fastest window: {x}")
        if windows and not math.isclose(x["gemm_gflops"], max(windows), rel_tol=1e-9):
            bad.append(f"gemm_gflops is not the row's fastest window: {x}")

    # The sgemm's OpenBLAS kernels are of the path's instruction set (bench_kernels picks them).
    gemm = doc["gemm"]
    if gemm["impl"] == "openblas":
        core = gemm.get("core", "")
        if not core:
            bad.append(f"no OpenBLAS core named in {gemm}")
        elif path == "avx2" and core in AVX512_CORES:
            bad.append(f"avx2 path timed against OpenBLAS's AVX-512 core {core}")
        elif avx512 and core not in AVX512_CORES:
            bad.append(f"{path} path timed against OpenBLAS's core {core}, not an AVX-512 one")

    expected = set()

    def expect(what, value, goal):
        expected.add(what)
        hits = [t for t in targets if t["what"] == what]
        if len(hits) != 1:
            bad.append(f"{len(hits)} target lines named '{what}' (want 1)")
            return
        t = hits[0]
        if not math.isclose(t["value"], value, rel_tol=1e-9):
            bad.append(f"'{what}': value {t['value']} but its rows give {value}")
        if t["target"] != goal:
            bad.append(f"'{what}': target {t['target']} on the {path} path (want {goal})")
        if t["met"] != (t["value"] >= t["target"]):
            bad.append(f"'{what}': met is {t['met']} for {t['value']} vs {t['target']}")

    f128, f64 = row("fp32", 256, 128, False), row("fp32", 256, 64, False)
    c64, b128 = row("fp32", 256, 64, True), row("bf16", 256, 128, False)
    b64 = row("bf16", 256, 64, False)
    ring64 = row("fp32", 128, 64, False)
    if None in (f128, f64, c64, b128, b64, ring64):
        return path, bad
    tag = " S=256 D="
    expect("fp32 fwd / row's sgemm, full, 1 thr," + tag + "128", f128["fwd_ratio"],
           0.85 if avx512 else 0.80)
    expect("fp32 bwd / row's sgemm, full, 1 thr," + tag + "128", f128["bwd_ratio"],
           0.70 if avx512 else 0.65)
    expect("bf16 fwd / fp32 fwd, full, 1 thr," + tag + "64", b64["fwd_ratio"] / f64["fwd_ratio"],
           1.6 if avx512 else 0.95)
    expect("bf16 bwd / fp32 bwd, full, 1 thr," + tag + "128", b128["bwd_ratio"] / f128["bwd_ratio"],
           1.3 if avx512 else 0.95)
    if not avx512:  # the AVX2+FMA list's further lines
        expect("fp32 fwd, full, 1 thr, D=64 / D=128", f64["fwd_ratio"] / f128["fwd_ratio"], 0.85)
        expect("fp32 bwd, full, 1 thr, D=64 / D=128", f64["bwd_ratio"] / f128["bwd_ratio"], 0.85)
        expect("fp32 causal fwd useful rate / full, 1 thr," + tag + "64",
               c64["fwd_ratio"] / f64["fwd_ratio"], 0.85)
        expect("fp32 ring-step fwd, 128x128 / S=256, D=64", ring64["fwd_ratio"] / f64["fwd_ratio"],
               0.80)
    if any(t["what"].startswith("fp32 fwd / row's sgemm") and t["what"].endswith("D=64")
           for t in targets):
        bad.append("an sgemm-ratio target at D = 64 (issue 10 sets them at D = 128)")
    # The lines of the other list must not appear (the AVX-512 list has no causal, ring-step,
    # D = 64 / D = 128 or two-thread lines).
    other = ("causal", "ring-step", "D=64 / D=128", "2 thr")
    for t in targets:
        if avx512 and any(o in t["what"] for o in other):
            bad.append(f"'{t['what']}' on the {path} path (not in issue 10's AVX-512 list)")
    return path, bad


def median(x):
    x = sorted(x)
    n = len(x)
    return x[n // 2] if n % 2 else 0.5 * (x[n // 2 - 1] + x[n // 2])


def check_scaling(bench, work):
    """--thread-scaling on a tiny problem: its JSON against its own rounds; returns failures."""
    out = os.path.join(work, "scaling.json")
    rounds = 3
    cmd = [bench, "--thread-scaling", str(rounds), "--seq", "128", "--dim", "64", "--dtype",
           "fp32", "bf16", "--threads", "2", "--heads", "2", "--kv-heads", "2", "--gemm-n", "64",
           "--json", out]
    env = {k: v for k, v in os.environ.items() if k not in ("LOOM_KERNEL", "OPENBLAS_CORETYPE")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if r.returncode != 0:
        return [f"--thread-scaling exited {r.returncode}:\n{r.stdout}\n{r.stderr}"]
    doc = json.load(open(out))
    bad = []
    ts, targets = doc["thread_scaling"], doc["targets"]
    avx512 = is_avx512_path(doc["kernel_path"])
    got = [(x["dtype"], x["kernel"]) for x in ts["results"]]
    want = [(t, k) for t in ("fp32", "bf16") for k in ("fwd", "bwd")]
    if got != want or ts["threads"] != 2 or ts["rounds"] != rounds:
        bad.append(f"--thread-scaling results {got}, threads {ts['threads']}, rounds "
                   f"{ts['rounds']} (want {want}, 2, {rounds})")
    for x in ts["results"]:
        rs = x["rounds"]
        if len(rs) != rounds or min(min(r.values()) for r in rs) <= 0:
            bad.append(f"--thread-scaling {x['dtype']} {x['kernel']}: want {rounds} rounds of "
                       f"positive times and windows: {rs}")
            continue
        loom = [r["t1_s"] / r["tn_s"] for r in rs]
        sgemm = [r["sgemmn"] / r["sgemm1"] for r in rs]
        for key, vals in (("loom_median", loom), ("sgemm_median", sgemm),
                          ("quotient_median", [a / b for a, b in zip(loom, sgemm)])):
            if not math.isclose(x[key], median(vals), rel_tol=1e-9):
                bad.append(f"--thread-scaling {x['dtype']} {x['kernel']}: {key} {x[key]}, its "
                           f"rounds give {median(vals)}")
        what = (f"{x['dtype']} {x['kernel']} 2 thr / 1 thr, paired median, full, S=128 D=64")
        hits = [t for t in targets if t["what"] == what]
        if avx512:
            continue
        if len(hits) != 1:
            bad.append(f"{len(hits)} --thread-scaling target lines named '{what}' (want 1)")
            continue
        t = hits[0]
        if (not math.isclose(t["value"], x["loom_median"], rel_tol=1e-9) or t["target"] != 1.85
                or t["met"] != (t["value"] >= 1.85)):
            bad.append(f"--thread-scaling target {t} (loom's median {x['loom_median']}, goal 1.85)")
    if avx512 and targets:
        bad.append(f"--thread-scaling target lines on the {doc['kernel_path']} path: {targets}")
    for args, needle in ((["--thread-scaling", "2", "--threads", "1"], "--threads gives 1"),
                         (["--thread-scaling", "0"], "--thread-scaling"),
                         # its calls are timed by the wall clock; --cpu-time would mix two clocks
                         (["--thread-scaling", "2", "--cpu-time"], "--thread-scaling")):
        r = subprocess.run([bench] + args, capture_output=True, text=True, timeout=60)
        if r.returncode == 0 or needle not in r.stderr or "thread scaling" in r.stdout:
            bad.append(f"{' '.join(args)}: exit {r.returncode}, stdout {r.stdout!r}, "
                       f"stderr {r.stderr!r} (want a refusal naming '{needle}')")
    return bad


def main():
    bench, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    path, bad = check_run(bench, work, None)
    paths = [path]
    if is_avx512_path(path):  # every AVX-512 CPU runs avx2: check the AVX2 list there too
        p2, bad2 = check_run(bench, work, "avx2")
        paths.append(p2)
        bad += bad2
    # Heads that do not divide: one error line naming both options, a non-zero exit, no rows.
    r = subprocess.run([bench, "--heads", "6", "--kv-heads", "4", "--no-torch"],
                       capture_output=True, text=True, timeout=60)
    err = r.stderr.strip().splitlines()
    if (r.returncode == 0 or len(err) != 1 or "--heads 6" not in err[0]
            or "--kv-heads 4" not in err[0] or r.stdout):
        bad.append(f"--heads 6 --kv-heads 4: exit {r.returncode}, stdout {r.stdout!r}, "
                   f"stderr {r.stderr!r}")
    # Every value checked before anything runs: one line, exit 2, nothing on stdout (--seq -5
    # aborted, --gemm-n 0 printed "inf: met", --dtype fp16 ran fp32 rows, --json onto a
    # directory failed after the sweep, exit 1).
    for args, needle, rc in ((["--seq", "-5"], "--seq: Value -5 not in range", 2),
                             (["--gemm-n", "0"], "--gemm-n: Value 0 not in range", 2),
                             (["--dtype", "fp16"], "--dtype: fp16 not in", 2),
                             (["--threads", "-1"], "--threads: Value -1 not in range", 2),
                             (["--dim", "300"], "--dim: Value 300 not in range", 2),
                             (["--json", work], "is a directory", 1)):
        r = subprocess.run([bench, "--no-torch", *args], capture_output=True, text=True,
                           timeout=60)
        err = r.stderr.strip().splitlines()
        if r.returncode != rc or len(err) != 1 or needle not in err[0] or r.stdout:
            bad.append(f"{' '.join(args)}: exit {r.returncode} (want {rc}), stdout "
                       f"{r.stdout[:200]!r}, stderr {r.stderr!r}")
    bad += check_scaling(bench, work)
    if bad:
        print("\n".join(bad))
        return 1
    print(f"bench_kernels targets consistent with their rows on the path(s) {', '.join(paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
