#!/usr/bin/python3
"""Checks bench_kernels' ggml rows (registered only where ggml_compare was built: -DLOOM_GGML_DIR).

  bench_ggml_check.py BENCH_KERNELS GGML_COMPARE WORKDIR

Runs BENCH_KERNELS on a tiny sweep (S = 256, D = 64, fp32 and bf16, one thread) and checks from
its --json that
  - there is one ggml row per fp32 one-thread shape (full and causal), none for bf16, each with
    ggml_compare's check passed (ggml's output within 1e-5 of the fp64 reference) before timing;
  - each ggml rate is the useful forward FLOPs (4 D per visible pair, S (S + 1) / 2 per head when
    causal) over the fastest of as many calls as loom's forward of that shape;
  - loom_over_ggml_fwd is loom's row's forward rate over ggml's;
then that --no-ggml leaves the rows out, and that ggml_compare refuses a bad --mask with a
non-zero exit. Nothing is timed against a threshold. Exit 0 when all hold, else 1.
"""
import json
import math
import os
import subprocess
import sys


def main():
    bench, ggml, work = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(work, exist_ok=True)
    bad = []
    base = [bench, "--seq", "256", "--dim", "64", "--dtype", "fp32", "bf16", "--ring", "0",
            "--threads", "1", "--min-time", "0.01", "--heads", "2", "--kv-heads", "2",
            "--gemm-n", "128", "--no-torch"]
    out = os.path.join(work, "with.json")
    r = subprocess.run(base + ["--json", out], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        print(f"bench_kernels exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
        return 1
    doc = json.load(open(out))
    rows = {(x["dtype"], x["causal"]): x for x in doc["results"]}
    grows = doc.get("ggml", [])
    if sorted(g["mask"] for g in grows) != ["causal", "full"]:
        bad.append(f"want one ggml row for each of full and causal, got {grows}")
    for g in grows:
        causal = g["mask"] == "causal"
        loom = rows.get(("fp32", causal))
        if loom is None:
            bad.append(f"no fp32 loom row for {g}")
            continue
        s, h, d = g["seq"], g["heads"], g["dim"]
        pairs = s * (s + 1) // 2 * h if causal else s * s * h
        calls = g["fwd_calls_s"]
        if len(calls) != len(loom["fwd_calls_s"]):
            bad.append(f"ggml timed {len(calls)} calls, loom's row {len(loom['fwd_calls_s'])}")
        if not math.isclose(g["fwd_gflops"], 4.0 * d * pairs / min(calls) * 1e-9, rel_tol=1e-9):
            bad.append(f"fwd_gflops is not the fastest call's useful rate: {g}")
        if pairs * 4 * d != 4 * d * loom["visible_pairs"]:
            bad.append(f"ggml counts {pairs} pairs, loom {loom['visible_pairs']}")
        if not math.isclose(g["loom_over_ggml_fwd"], loom["fwd_gflops"] / g["fwd_gflops"],
                            rel_tol=1e-9):
            bad.append(f"loom_over_ggml_fwd is not loom's rate over ggml's: {g}")
    if "ggml rows: " not in r.stdout or "\n ggml " not in r.stdout:
        bad.append(f"no ggml header line or table row in:\n{r.stdout}")

    out2 = os.path.join(work, "without.json")
    r2 = subprocess.run(base + ["--no-ggml", "--json", out2], capture_output=True, text=True,
                        timeout=300)
    if r2.returncode != 0 or "ggml" in json.load(open(out2)) or "\n ggml " in r2.stdout:
        bad.append(f"--no-ggml: exit {r2.returncode}, rows left in:\n{r2.stdout}")

    r3 = subprocess.run([ggml, "--mask", "diagonal"], capture_output=True, text=True, timeout=60)
    if r3.returncode == 0 or "mask" not in (r3.stdout + r3.stderr):
        bad.append(f"ggml_compare --mask diagonal: exit {r3.returncode}, {r3.stdout}{r3.stderr}")

    for b in bad:
        print("FAIL:", b)
    print(f"{len(grows)} ggml rows checked, {len(bad)} failures")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
