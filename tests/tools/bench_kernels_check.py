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
  - the check before timing covered every timed configuration (each row's dtype, D, mask and
    thread count, at the run's blocks, kernel path and GQA group), within its limits;
and that a failed check of either dtype (LOOM_TEST_BENCH_CHECK_FAIL, with --block-q 32
--block-k 48, which the check must use) is one line on stderr, exit 1, nothing timed, no --json;
that --tile-ops has one GEMM column per distinct call (p^T do and ds^T q were the same call); and
that --heads not a multiple of --kv-heads, and each out-of-range value, is one error line
and a non-zero exit before anything runs; that an option a mode (--tile-ops, --sgemm-window,
--thread-scaling) does not use, or a --torch-python no Python is run with, is one line naming both
and exit 2; that --json - leaves the JSON alone on standard output; that a 3-thread sweep's sgemm
scaling line names 3 threads; and that a --torch-json row repeated, or beside GQA rows, is said
so.
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
import re
import subprocess
import sys


AVX512_CORES = ("SkylakeX", "Cooperlake", "SapphireRapids")


def is_avx512_path(path):
    """The paths issue 10's AVX-512 list applies to: avx512, avx512bf16 and amx (the avx512 table
    with bf16 GEMMs on AMX tiles)."""
    return path.startswith("avx512") or path == "amx"


def basis_of(what):
    """The basis a target line's value must have (bench_kernels prints and records it)."""
    if "/ row's sgemm" in what:
        return "gemm_ratio"
    if "2 thr / 1 thr, paired median" in what:
        return "paired_median"
    if "2 thr / 1 thr" in what or what.startswith("loom / torch"):
        return "gflops_quotient"
    return "gemm_ratio_quotient"  # causal / full, ring-step, bf16 / fp32, D=64 / D=128


TAGS = {"gemm_ratio": "[/gemm]", "gemm_ratio_quotient": "[/gemm over /gemm]",
        "gflops_quotient": "[GFLOP/s over GFLOP/s]", "paired_median": "[median of t1 / tN]"}


def value_text(value, met):
    """The printed value: three decimals, rounded down where the goal was missed, so that a value
    that missed never prints equal to its goal ("0.85 (target >= 0.85: NOT met)" was 0.8474)."""
    return f"{value:.3f}" if met else f"{math.floor(value * 1e3) / 1e3:.3f}"


def check_printed(stdout, doc, path):
    """The printed target lines against the JSON's: each once, its value as value_text gives it
    (and so never equal to its goal when NOT met), its verdict, its basis tag with the legend of
    that basis above, and the header naming the list of the path (the AVX2+FMA list on a path
    the issue sets none for, "for reference")."""
    bad = []
    lines = stdout.splitlines()
    avx512 = is_avx512_path(path)
    reference = not avx512 and path != "avx2"
    want_list = "AVX-512" if avx512 else "AVX2+FMA"
    heads = [x for x in lines if x.startswith("targets")]
    if (len(heads) != 1 or f"issue 10's {want_list} list" not in heads[0]
            or ("for reference" in heads[0]) != reference or path not in heads[0]):
        bad.append(f"targets header {heads} on the {path} path (want issue 10's {want_list} list"
                   f"{', for reference' if reference else ''})")
    if doc.get("target_list") != want_list or doc.get("target_list_for_reference") != reference:
        bad.append(f"JSON target_list {doc.get('target_list')!r}, for reference "
                   f"{doc.get('target_list_for_reference')!r} on the {path} path")
    for t in doc["targets"]:
        hits = [x for x in lines if x.startswith("  " + t["what"] + " ")]
        if len(hits) != 1:
            bad.append(f"{len(hits)} printed lines for the target '{t['what']}' (want 1)")
            continue
        line = hits[0]
        if "measured" not in t:
            bad.append(f"target {t} does not say whether it was measured")
            continue
        if not t["measured"]:
            if ": not measured, needs " + t.get("needs", "?") not in line or t["met"]:
                bad.append(f"'{line}' for the unmeasured target {t}")
            continue
        basis = basis_of(t["what"])
        if t.get("basis") != basis or not line.rstrip().endswith(TAGS[basis]):
            bad.append(f"'{line}': basis {t.get('basis')} (want {basis}, tagged {TAGS[basis]})")
        if basis not in doc.get("target_bases", {}) or not [
                x for x in lines if x.startswith("  " + TAGS[basis] + " ")]:
            bad.append(f"no legend for the basis {basis} of '{t['what']}'")
        m = re.match(r"\s+(\S+)\s+\(target >= (\S+): (met|NOT met)\)",
                     line[len("  " + t["what"]):])
        if not m:
            bad.append(f"cannot read the printed target line '{line}'")
            continue
        shown, goal, verdict = m.group(1), float(m.group(2)), m.group(3)
        if shown != value_text(t["value"], t["met"]) or verdict != ("met" if t["met"] else
                                                                    "NOT met"):
            bad.append(f"'{line}': want {value_text(t['value'], t['met'])}, "
                       f"{'met' if t['met'] else 'NOT met'} for the value {t['value']}")
        elif (float(shown) >= goal) != t["met"]:
            bad.append(f"'{line}': the printed value reads as the other verdict")
    return bad


def check_covers_rows(doc, what):
    """The check before timing covered every configuration the run timed: each row's dtype, D,
    mask (ring-step rows: full) and thread count, at the run's blocks and kernel path, with the
    run's GQA group, each case within its limits; returns failures. (It checked fp32 alone, on
    48 x 40 tiles and the all-threads count: bf16 rows and --block-q / --block-k went unchecked.)"""
    c = doc.get("check", {})
    cases = c.get("cases", [])
    bad = []
    if not c.get("ok") or not cases:
        return [f"{what}: no check cases before timing: {c}"]
    if c.get("block") != doc.get("block", [64, 64]) or c.get("kernel_path") != doc["kernel_path"]:
        bad.append(f"{what}: checked blocks {c.get('block')} on {c.get('kernel_path')}, timed "
                   f"{doc.get('block')} on {doc['kernel_path']}")
    got = {(x["dtype"], x["dim"], x["causal"], x["threads"]) for x in cases}
    rows = doc["results"] if "results" in doc else [
        dict(x, causal=False) for x in doc["thread_scaling"]["results"]]
    for x in rows:
        threads = [1, x["threads"]] if "rounds" in x else [x["threads"]]
        for t in threads:
            if (x["dtype"], x["dim"], x["causal"], t) not in got:
                bad.append(f"{what}: {x['dtype']} D={x['dim']} causal={x['causal']} {t} thr "
                           f"timed, not checked (checked: {sorted(got)})")
        if x["heads"] // x["kv_heads"] != c["heads"] // c["kv_heads"]:
            bad.append(f"{what}: checked H={c['heads']} Hkv={c['kv_heads']}, timed "
                       f"H={x['heads']} Hkv={x['kv_heads']}")
    for x in cases:
        over = [k for k in x["errors"] if not x["errors"][k] <= x["limits"][k]]
        if over:
            bad.append(f"{what}: check case {x} passed with {over} over the limit")
    return bad


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
        if t.get("measured") is False or t["value"] is None:
            bad.append(f"'{what}': not measured although its rows were: {t}")
            return
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
    # This sweep has one thread only: the two-thread lines are there, not measured, saying so
    # (they were dropped without a word).
    if not avx512:
        for dtype in ("fp32", "bf16"):
            for d in ("128", "64"):
                for k in ("fwd", "bwd"):
                    what = f"{dtype} {k} 2 thr / 1 thr, full, S=256 D={d}"
                    hits = [t for t in targets if t["what"] == what]
                    if (len(hits) != 1 or hits[0].get("measured") is not False
                            or hits[0]["met"] or "--threads 2" not in hits[0].get("needs", "")):
                        bad.append(f"'{what}': {hits} (want one line, not measured, needing "
                                   "--threads 2)")
    # --no-torch: each loom / torch line is there, not measured, needing PyTorch's rows.
    for mask, kinds in (("full", ("fwd", "bwd")), ("causal", ("fwd",))):
        for d in ("128", "64"):
            for k in kinds:
                what = f"loom / torch {k}, fp32 Sq=256 H=2 D={d} {mask} 1 thr"
                hits = [t for t in targets if t["what"] == what]
                if (len(hits) != 1 or hits[0].get("measured") is not False
                        or "PyTorch" not in hits[0].get("needs", "")):
                    bad.append(f"'{what}': {hits} (want one line, not measured, needing PyTorch)")
    bad += check_printed(r.stdout, doc, path)
    bad += check_covers_rows(doc, f"LOOM_KERNEL={kernel}")
    if any(t["what"].startswith("fp32 fwd / row's sgemm") and t["what"].endswith("D=64")
           for t in targets):
        bad.append("an sgemm-ratio target at D = 64 (issue 10 sets them at D = 128)")
    # The lines of the other list must not appear (the AVX-512 list has no causal, ring-step,
    # D = 64 / D = 128 or two-thread lines).
    other = ("causal", "ring-step", "D=64 / D=128", "2 thr")
    for t in targets:
        if avx512 and not t["what"].startswith("loom / torch") and any(o in t["what"]
                                                                      for o in other):
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
        if (not t.get("measured") or not math.isclose(t["value"], x["loom_median"], rel_tol=1e-9)
                or t["target"] != 1.85 or t["met"] != (t["value"] >= 1.85)):
            bad.append(f"--thread-scaling target {t} (loom's median {x['loom_median']}, goal 1.85)")
    if avx512 and targets:
        bad.append(f"--thread-scaling target lines on the {doc['kernel_path']} path: {targets}")
    bad += check_covers_rows(doc, "--thread-scaling")
    if not avx512:
        bad += check_printed(r.stdout, doc, doc["kernel_path"])
    for args, needle in ((["--thread-scaling", "2", "--threads", "1"], "--threads gives 1"),
                         (["--thread-scaling", "0"], "--thread-scaling"),
                         # its calls are timed by the wall clock; --cpu-time would mix two clocks
                         (["--thread-scaling", "2", "--cpu-time"], "--thread-scaling")):
        r = subprocess.run([bench] + args, capture_output=True, text=True, timeout=60)
        if r.returncode == 0 or needle not in r.stderr or "thread scaling" in r.stdout:
            bad.append(f"{' '.join(args)}: exit {r.returncode}, stdout {r.stdout!r}, "
                       f"stderr {r.stderr!r} (want a refusal naming '{needle}')")
    return bad


def runnable_paths(bench):
    """The kernel paths this CPU runs, from the "kernel path:" line of a --help-free tiny run."""
    r = subprocess.run([bench, "--seq", "16", "--dim", "16", "--dtype", "fp32", "--ring", "0",
                        "--threads", "1", "--min-time", "0.001", "--gemm-n", "16", "--no-check",
                        "--no-torch"], capture_output=True, text=True, timeout=120)
    m = re.search(r"^kernel path: \S+ \(LOOM_KERNEL = auto \| portable \| (.*)\)$", r.stdout,
                  re.M)
    if not m:
        return []
    return [x for x in m.group(1).split(", ") if "not on this CPU" not in x]


def check_reference_path(bench, work, kernel):
    """A tiny sweep on a path issue 10 sets no targets for (sse4, ssse3, scalar): the AVX2+FMA
    list shown for reference, each line it cannot compute (no D = 128, no bf16, no ring, one
    thread) printed and recorded as not measured with what it needs; and --seq / --dim given
    twice run each shape once (--seq 128 128 ran every row four times, every target twice)."""
    out = os.path.join(work, f"bench-{kernel}.json")
    cmd = [bench, "--seq", "128", "128", "--dim", "64,64", "--dtype", "fp32", "--ring", "0",
           "--threads", "1", "--min-time", "0.01", "--heads", "2", "--kv-heads", "2",
           "--gemm-n", "128", "--no-check", "--no-torch", "--json", out]
    env = {k: v for k, v in os.environ.items() if k not in ("LOOM_KERNEL", "OPENBLAS_CORETYPE")}
    env["LOOM_KERNEL"] = kernel
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if r.returncode != 0:
        return [f"bench_kernels (LOOM_KERNEL={kernel}) exited {r.returncode}:\n{r.stdout}\n"
                f"{r.stderr}"]
    doc = json.load(open(out))
    bad = []
    shapes = [(x["seq_q"], x["dim"], x["causal"]) for x in doc["results"]]
    if sorted(shapes) != [(128, 64, False), (128, 64, True)]:
        bad.append(f"--seq 128 128 --dim 64,64: rows {shapes} (want each shape once)")
    whats = [t["what"] for t in doc["targets"]]
    if len(whats) != len(set(whats)):
        bad.append(f"a target line twice: {whats}")
    needs = {  # every line of the AVX2+FMA list, and what this run lacks for it
        "fp32 fwd / row's sgemm, full, 1 thr, S=128 D=128": "--dim 128",
        "fp32 bwd / row's sgemm, full, 1 thr, S=128 D=128": "--dim 128",
        "fp32 fwd 2 thr / 1 thr, full, S=128 D=64": "--threads 2",
        "fp32 bwd 2 thr / 1 thr, full, S=128 D=64": "--threads 2",
        "fp32 ring-step fwd, 512x512 / S=128, D=64": "--ring",
        "fp32 ring-step bwd, 512x512 / S=128, D=64": "--ring",
        "bf16 fwd / fp32 fwd, full, 1 thr, S=128 D=64": "bf16",
        "bf16 bwd / fp32 bwd, full, 1 thr, S=128 D=64": "bf16",
        "fp32 fwd, full, 1 thr, D=64 / D=128": "--dim 64 128",
        "fp32 bwd, full, 1 thr, D=64 / D=128": "--dim 64 128",
        "loom / torch fwd, fp32 Sq=128 H=2 D=64 full 1 thr": "PyTorch",
        "loom / torch bwd, fp32 Sq=128 H=2 D=64 full 1 thr": "PyTorch",
        "loom / torch fwd, fp32 Sq=128 H=2 D=64 causal 1 thr": "PyTorch",
    }
    for what, need in needs.items():
        hits = [t for t in doc["targets"] if t["what"] == what]
        if (len(hits) != 1 or hits[0].get("measured") is not False
                or need not in hits[0].get("needs", "")):
            bad.append(f"'{what}': {hits} (want one line, not measured, needing {need})")
    for what in ("fp32 causal fwd useful rate / full, 1 thr, S=128 D=64",
                 "fp32 causal bwd useful rate / full, 1 thr, S=128 D=64"):
        hits = [t for t in doc["targets"] if t["what"] == what]
        if len(hits) != 1 or not hits[0].get("measured"):
            bad.append(f"'{what}': {hits} (want one measured line)")
    return bad + check_printed(r.stdout, doc, kernel)


def check_torch_json(bench, work):
    """--torch-json: read and checked before anything is timed, its rows matched to loom's by
    the whole shape, and the errors of a file that is not one (no timing is judged)."""
    bad = []
    base = [bench, "--seq", "128", "--dim", "64", "--dtype", "fp32", "--ring", "0", "--threads",
            "1", "--min-time", "0.01", "--heads", "2", "--kv-heads", "2", "--gemm-n", "128",
            "--no-check"]

    def row(causal, heads, fwd, bwd, **extra):
        return dict(dtype="fp32", seq_q=128, seq_k=128, heads=heads, dim=64, causal=causal,
                    threads=1, fwd_s=1.0, bwd_s=1.0, fwd_gflops=fwd, bwd_gflops=bwd,
                    gemm_gflops=50.0, **extra)

    fake = os.path.join(work, "torch-fake.json")
    with open(fake, "w") as f:  # a torch_compare.py output, by hand (no torch needed)
        json.dump({"torch": "test", "attention": "hand-written", "results": [
            row(False, 2, 1000.0, 1000.0, kv_heads=1),  # other kv heads: never loom's row
            row(False, 2, 10.0, 20.0),                  # loom's full row
            row(True, 1, 5.0, 5.0),                     # one head: never loom's two-head row
            row(True, 2, 0.0, 7.0)]}, f)                # loom's causal row, rate 0: no verdict
    out = os.path.join(work, "bench-torch-json.json")
    r = subprocess.run(base + ["--torch-json", fake, "--json", out], capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0:
        return [f"--torch-json (hand-written) exited {r.returncode}:\n{r.stdout}\n{r.stderr}"]
    doc = json.load(open(out))
    loom = {x["causal"]: x for x in doc["results"]}
    tg = {t["what"]: t for t in doc["targets"]}
    tag = " fp32 Sq=128 H=2 D=64 "
    for k, rate in (("fwd", 10.0), ("bwd", 20.0)):
        t = tg.get(f"loom / torch {k},{tag}full 1 thr")
        want = loom[False][f"{k}_gflops"] / rate
        if not t or not t.get("measured") or not math.isclose(t["value"], want, rel_tol=1e-9):
            bad.append(f"loom / torch {k} full: {t} (want loom's rate over the PyTorch row of "
                       f"the same heads and kv heads: {want})")
    t = tg.get(f"loom / torch fwd,{tag}causal 1 thr")
    if not t or t.get("measured") is not False or "positive" not in t.get("needs", ""):
        bad.append(f"loom / torch fwd causal: {t} (want not measured: its PyTorch row's rate is 0,"
                   " the one-head row is another shape)")
    if not re.search(r"^  torch fp32 Sq=128 H=1 D=64 causal 1 thr: .*no loom row", r.stdout, re.M):
        bad.append("the one-head PyTorch row is not said to match no loom row")
    if not re.search(r"^  torch fp32 Sq=128 H=2 D=64 causal 1 thr: fwd 0\.0.*not positive",
                     r.stdout, re.M):
        bad.append("the PyTorch row of rate 0 is not said to measure nothing")
    bad += check_printed(r.stdout, doc, doc["kernel_path"])

    # --ring equal to the --seq: its rows are the full one-thread rows, timed once (they were
    # timed again, and every loom / torch line of the shape printed twice with two values).
    ring_out = os.path.join(work, "bench-ring-is-seq.json")
    r = subprocess.run([x if x != "0" or base[i - 1] != "--ring" else "128"
                        for i, x in enumerate(base)] + ["--torch-json", fake, "--json", ring_out],
                       capture_output=True, text=True, timeout=300)
    whats = [t["what"] for t in json.load(open(ring_out))["targets"]] if r.returncode == 0 else []
    shapes = [(x["dtype"], x["seq_q"], x["seq_k"], x["dim"], x["causal"], x["threads"])
              for x in json.load(open(ring_out))["results"]] if r.returncode == 0 else []
    if (r.returncode != 0 or len(set(whats)) != len(whats) or len(set(shapes)) != len(shapes)
            or "# --ring 128: the full-mask one-thread rows of --seq 128 above" not in r.stdout):
        bad.append(f"--ring 128 --seq 128: exit {r.returncode}, target names {whats}, rows "
                   f"{shapes} (want each once, and the line saying the ring rows are the full "
                   f"rows), stderr {r.stderr[-300:]!r}")

    # A file that repeats a row: the first of the shape is compared, the repeat said to be one
    # (it was "no loom row of this shape" beside loom's row of that shape).
    dup = os.path.join(work, "torch-dup.json")
    with open(dup, "w") as f:
        json.dump({"torch": "test", "results": [row(False, 2, 10.0, 20.0),
                                                row(False, 2, 30.0, 40.0)]}, f)
    r = subprocess.run(base + ["--torch-json", dup, "--json", out], capture_output=True,
                       text=True, timeout=300)
    lines = [x for x in r.stdout.splitlines() if x.startswith("  torch fp32 Sq=128 H=2 D=64 full")]
    if r.returncode != 0 or len(lines) != 2 or "no loom row" in r.stdout or \
            "repeated row" not in lines[1] or "repeated" in lines[0]:
        bad.append(f"--torch-json with a repeated row: exit {r.returncode}, lines {lines} (want the "
                   "second said to be a repeated row, no 'no loom row')")
    elif r.returncode == 0:
        t = {x["what"]: x for x in json.load(open(out))["targets"]}.get(
            f"loom / torch fwd,{tag}full 1 thr")
        want = {x["causal"]: x for x in json.load(open(out))["results"]}[False]["fwd_gflops"] / 10
        if not t or not t.get("measured") or not math.isclose(t["value"], want, rel_tol=1e-9):
            bad.append(f"--torch-json with a repeated row: {t} (want the first row's ratio {want})")
    # GQA beside --torch-json: the lines say PyTorch runs no GQA and what compares (they said
    # "a PyTorch row of this shape (there is none)").
    gqa = [x if not (x == "2" and base[i - 1] == "--kv-heads") else "1"
           for i, x in enumerate(base)]
    r = subprocess.run(gqa + ["--torch-json", dup, "--json", out], capture_output=True,
                       text=True, timeout=300)
    lt = [t for t in json.load(open(out))["targets"] if t["what"].startswith("loom / torch")] \
        if r.returncode == 0 else []
    if len(lt) != 3 or not all("no GQA" in t.get("needs", "") and
                               "--kv-heads equal to --heads" in t["needs"] for t in lt):
        bad.append(f"--kv-heads 1 --heads 2 --torch-json: exit {r.returncode}, loom / torch "
                   f"lines {lt} (want 3, each needing --kv-heads equal to --heads: no GQA)")

    # Files that are not a torch_compare.py output: one line, exit 1, before anything runs.
    def write(name, text):
        path = os.path.join(work, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    fifo = os.path.join(work, "torch-fifo")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    cases = [(out, "not a torch_compare.py output"),  # a bench_kernels output
             (write("t-ints.json", '{"torch": "x", "results": [1, 2]}'),
              "results[0] is not an object"),
             (write("t-noseq.json", '{"torch": "x", "results": [{"dtype": "fp32"}]}'),
              '"seq_q" is missing'),
             (write("t-str.json", json.dumps({"torch": "x", "results": [
                 dict(row(False, 2, 1.0, 1.0), heads="2")]})), '"heads" is not an integer'),
             (write("t-bad.json", "{"), "not JSON"),
             (os.path.join(work, "no-such.json"), "cannot open"),
             (fifo, "not a regular file"),
             (work, "is a directory")]
    for path, needle in cases:
        try:
            r = subprocess.run(base + ["--torch-json", path], capture_output=True, text=True,
                               timeout=60)
        except subprocess.TimeoutExpired:
            bad.append(f"--torch-json {path}: still running after 60 s")
            continue
        err = r.stderr.strip().splitlines()
        if r.returncode != 1 or len(err) != 1 or needle not in err[0] or r.stdout:
            bad.append(f"--torch-json {path}: exit {r.returncode}, stdout {r.stdout[:300]!r}, "
                       f"stderr {r.stderr!r} (want one line naming '{needle}', exit 1, nothing "
                       f"timed)")
    # The output naming the input: refused, the input left as it was.
    before = open(fake).read()
    r = subprocess.run(base + ["--torch-json", fake, "--json", fake], capture_output=True,
                       text=True, timeout=60)
    if r.returncode != 2 or "name the same file" not in r.stderr or open(fake).read() != before:
        bad.append(f"--torch-json F --json F: exit {r.returncode}, stderr {r.stderr!r}, the input "
                   f"{'kept' if open(fake).read() == before else 'replaced'}")
    return bad


def check_refusals(bench, work):
    """Options a mode would ignore: one line naming the option and the mode, exit 2, nothing run,
    no file written (--tile-ops --seq 128, --sgemm-window --no-check, --thread-scaling --ring 64
    and more ran, ignoring them). Options each mode uses still run."""
    bad = []
    out = os.path.join(work, "ignored.json")
    tiny = ["--seq", "32", "--dim", "16", "--dtype", "fp32", "--ring", "0", "--threads", "1",
            "--min-time", "0.001", "--gemm-n", "16", "--heads", "1", "--kv-heads", "1",
            "--no-check"]
    for args, needles in (
            (["--tile-ops", "--json", out], ("--tile-ops", "--json")),
            (["--sgemm-window", "0.01", "--json", out], ("--sgemm-window", "--json")),
            (["--tile-ops", "--sgemm-window", "0.01"], ("--tile-ops", "--sgemm-window")),
            (["--thread-scaling", "1", "--torch-json", out], ("--thread-scaling", "--torch-json")),
            (["--tile-ops", "--torch"], ("--tile-ops", "--torch")),
            (["--tile-ops", "--cpu-time"], ("--tile-ops", "--cpu-time")),
            (["--tile-ops", "--seq", "128"], ("--tile-ops excludes --seq",)),
            (["--tile-ops", "--ring", "0"], ("--tile-ops excludes --ring",)),
            (["--tile-ops", "--no-torch"], ("--tile-ops excludes --no-torch",)),
            (["--tile-ops", "--threads", "1"], ("--tile-ops excludes --threads",)),
            (["--tile-ops", "--dim", "64", "128"], ("--tile-ops", "one --dim")),
            (["--sgemm-window", "0.01", "--seq", "128"], ("--sgemm-window excludes --seq",)),
            (["--sgemm-window", "0.01", "--no-check"], ("--sgemm-window excludes --no-check",)),
            (["--sgemm-window", "0.01", "--threads", "2"], ("--sgemm-window excludes --threads",)),
            (["--thread-scaling", "1", "--ring", "64"], ("--thread-scaling excludes --ring",)),
            (["--thread-scaling", "1", "--min-time", "1"], ("--thread-scaling excludes --min-time",)),
            (["--thread-scaling", "1", "--no-torch"], ("--thread-scaling excludes --no-torch",)),
            (["--thread-scaling", "1", "--seq", "64", "128"], ("--thread-scaling", "one --seq")),
            # the sweep (a tiny one, should it run): a Python it would not run
            (tiny + ["--no-torch", "--torch-python", "/usr/bin/python3"],
             ("--no-torch", "--torch-python")),
            (tiny + ["--torch-json", out, "--torch-python", "/usr/bin/python3"],
             ("--torch-json", "--torch-python")),
            (tiny + ["--torch-json", out, "--no-torch"], ("--torch-json", "--no-torch"))):
        try:
            r = subprocess.run([bench] + args, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            bad.append(f"{' '.join(args)}: still running after 60 s (want a refusal)")
            continue
        err = r.stderr.strip().splitlines()
        if r.returncode != 2 or len(err) != 1 or not all(n in err[0] for n in needles) or \
                r.stdout or os.path.exists(out):
            bad.append(f"{' '.join(args)}: exit {r.returncode}, stdout {r.stdout[:200]!r}, "
                       f"stderr {r.stderr!r} (want one line naming {needles}, exit 2)")
    # What the modes use runs; --sgemm-window says which clock timed it (--cpu-time's CPU clock
    # was used without a word).
    for args, needle in ((["--sgemm-window", "0.01", "--gemm-n", "16", "--keep-openblas-core"],
                          "(wall clock)"),
                         (["--sgemm-window", "0.01", "--gemm-n", "16", "--cpu-time"],
                          "(process CPU time, --cpu-time)")):
        r = subprocess.run([bench] + args, capture_output=True, text=True, timeout=60)
        if r.returncode != 0 or needle not in r.stdout:
            bad.append(f"{' '.join(args)}: exit {r.returncode}, stdout {r.stdout!r} (want a line "
                       f"saying {needle})")
    return bad


def check_stdout_json(bench, work):
    """--json -: the JSON alone on standard output, the table on standard error (they were mixed,
    unparseable); and the sgemm scaling line of a 3-thread run names 3 threads (it said 2)."""
    bad = []
    tiny = [bench, "--seq", "32", "--dim", "16", "--dtype", "fp32", "--ring", "0", "--min-time",
            "0.001", "--gemm-n", "16", "--heads", "1", "--kv-heads", "1", "--no-check",
            "--no-torch"]
    r = subprocess.run(tiny + ["--threads", "1", "--json", "-"], capture_output=True, text=True,
                       timeout=120)
    try:
        rows = json.loads(r.stdout)["results"]
    except (ValueError, KeyError):
        rows = None
    if r.returncode != 0 or not rows or "dtype" not in r.stderr or "kernel path:" not in r.stderr:
        bad.append(f"--json -: exit {r.returncode}, stdout {r.stdout[:300]!r}, stderr "
                   f"{r.stderr[:300]!r} (want the JSON alone on stdout, the table on stderr)")
    r = subprocess.run(tiny + ["--threads", "3"], capture_output=True, text=True, timeout=120)
    line = [x for x in r.stdout.splitlines() if x.startswith("sgemm scaling")]
    if r.returncode != 0 or len(line) != 1 or "(3 thr / 1 thr)" not in line[0] or \
            "3-thread rows" not in line[0] or "2-thread" in line[0] or "2.85" not in line[0]:
        bad.append(f"--threads 3: exit {r.returncode}, sgemm scaling line {line} (want it to "
                   "name 3 threads and 0.95 x 3 = 2.85, not 2)")
    return bad


def check_scaling_other_count(bench, work, kernel):
    """--thread-scaling with 4 threads on a path with the two-thread target: the medians in the
    table, the target lines not judged (the target is for two threads; 4 was judged against it)."""
    out = os.path.join(work, "scaling4.json")
    cmd = [bench, "--thread-scaling", "1", "--seq", "64", "--dim", "32", "--dtype", "fp32",
           "--threads", "4", "--heads", "1", "--kv-heads", "1", "--gemm-n", "16", "--no-check",
           "--json", out]
    env = {k: v for k, v in os.environ.items() if k not in ("LOOM_KERNEL", "OPENBLAS_CORETYPE")}
    env["LOOM_KERNEL"] = kernel
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if r.returncode != 0:
        return [f"--thread-scaling --threads 4 exited {r.returncode}:\n{r.stdout}\n{r.stderr}"]
    doc = json.load(open(out))
    bad = []
    if [x["threads"] for x in doc["thread_scaling"]["results"]] != [4, 4]:
        bad.append(f"--thread-scaling --threads 4 results: {doc['thread_scaling']['results']}")
    for k in ("fwd", "bwd"):
        what = f"fp32 {k} 2 thr / 1 thr, paired median, full, S=64 D=32"
        hits = [t for t in doc["targets"] if t["what"] == what]
        if (len(hits) != 1 or hits[0].get("measured") is not False
                or "--threads 2" not in hits[0].get("needs", "")):
            bad.append(f"--thread-scaling --threads 4: '{what}': {hits} (want one line, not "
                       "measured, needing --threads 2)")
    return bad + check_printed(r.stdout, doc, kernel)


def check_checks(bench, work):
    """The check before timing with --block-q 32 --block-k 48 and GQA: it covers each timed row
    at those blocks; and a failed check (LOOM_TEST_BENCH_CHECK_FAIL=<dtype> negates that dtype's
    dq in the check, a sign error) of either dtype is one line on stderr, exit 1, no row printed
    and no --json written (the bf16 rows were never checked); returns failures."""
    bad = []
    tiny = [bench, "--seq", "64", "--dim", "32", "--dtype", "fp32,bf16", "--ring", "0",
            "--threads", "1", "--min-time", "0.001", "--gemm-n", "16", "--heads", "4",
            "--kv-heads", "2", "--block-q", "32", "--block-k", "48", "--no-torch"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOOM_KERNEL", "OPENBLAS_CORETYPE", "LOOM_TEST_BENCH_CHECK_FAIL")}
    out = os.path.join(work, "blocks.json")
    r = subprocess.run(tiny + ["--json", out], capture_output=True, text=True, timeout=120,
                       env=env)
    if r.returncode != 0:
        return [f"--block-q 32 --block-k 48: exit {r.returncode}:\n{r.stdout}\n{r.stderr}"]
    doc = json.load(open(out))
    bad += check_covers_rows(doc, "--block-q 32 --block-k 48")
    if doc.get("check", {}).get("block") != [32, 48]:
        bad.append(f"--block-q 32 --block-k 48: checked blocks {doc.get('check', {}).get('block')}")
    for dtype in ("fp32", "bf16"):
        out = os.path.join(work, f"failed-{dtype}.json")
        if os.path.exists(out):
            os.remove(out)
        r = subprocess.run(tiny + ["--json", out], capture_output=True, text=True, timeout=120,
                           env=dict(env, LOOM_TEST_BENCH_CHECK_FAIL=dtype))
        err = r.stderr.strip().splitlines()
        if (r.returncode != 1 or len(err) != 1 or "check FAILED" not in err[0]
                or f"{dtype} D=32" not in err[0] or "blocks 32 x 48" not in err[0]
                or "dq relative error" not in err[0] or r.stdout or os.path.exists(out)):
            bad.append(f"a failed {dtype} check: exit {r.returncode}, stdout {r.stdout[:300]!r}, "
                       f"stderr {r.stderr!r}, --json written: {os.path.exists(out)} (want one "
                       "line naming it, exit 1, nothing timed)")
    return bad


def check_tile_ops(bench):
    """--tile-ops: one GEMM column per distinct call (its "p^T do" and "ds^T q" columns timed the
    identical call, the second saying nothing the first did not); returns failures."""
    r = subprocess.run([bench, "--tile-ops", "--dim", "16"], capture_output=True, text=True,
                       timeout=120)
    lines = r.stdout.splitlines()
    head = [x for x in lines if x.startswith("target ")]
    if r.returncode != 0 or len(head) != 1:
        return [f"--tile-ops: exit {r.returncode}, stdout {r.stdout!r}, stderr {r.stderr!r}"]
    cols = re.split(r"\s{2,}", head[0].split("|")[0].strip())[1:]
    bad = []
    if cols != ["q k^T", "p v", "p^T do"]:
        bad.append(f"--tile-ops GEMM columns {cols} (want q k^T, p v, p^T do: ds^T q is the same "
                   "call as p^T do)")
    if not any("p^T do is also ds^T q" in x for x in lines):
        bad.append("--tile-ops: no note that p^T do is also ds^T q")
    for x in lines:
        m = re.match(r"(\S+)\s+([\d.]+(?:\s+[\d.]+)*)\s+\|", x)
        if m and len(m.group(2).split()) != len(cols):
            bad.append(f"--tile-ops row {x!r}: {len(m.group(2).split())} GEMM values for "
                       f"{len(cols)} columns")
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
    # Heads that do not divide: one error line naming both options, exit 2 (a bad command line;
    # it was 1, a failed check's status), no rows.
    r = subprocess.run([bench, "--heads", "6", "--kv-heads", "4", "--no-torch"],
                       capture_output=True, text=True, timeout=60)
    err = r.stderr.strip().splitlines()
    if (r.returncode != 2 or len(err) != 1 or "--heads 6" not in err[0]
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
    runnable = runnable_paths(bench)
    if not runnable:
        bad.append("no 'kernel path:' line listing the runnable paths")
    # A path issue 10 sets no targets for, where this CPU runs one (x86-64: sse4, ssse3, scalar).
    ref = [p for p in runnable if p in ("sse4", "ssse3", "scalar")]
    if ref:
        bad += check_reference_path(bench, work, ref[0])
        paths.append(ref[0])
    two_thread = [p for p in runnable if p == "avx2"] + ref  # paths with the two-thread target
    if two_thread:
        bad += check_scaling_other_count(bench, work, two_thread[0])
    bad += check_torch_json(bench, work)
    bad += check_refusals(bench, work)
    bad += check_stdout_json(bench, work)
    bad += check_checks(bench, work)
    bad += check_tile_ops(bench)
    if bad:
        print("\n".join(bad))
        return 1
    print(f"bench_kernels targets consistent with their rows on the path(s) {', '.join(paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
