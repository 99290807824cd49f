#!/usr/bin/python3
"""Checks bench_kernels' PyTorch rows (PyTorch eager on each shape, right after loom's row) on a
tiny sweep.

  bench_torch_check.py BENCH_KERNELS PYTHON_WITH_TORCH WORKDIR

Runs BENCH_KERNELS on S = 256, D = 64 (full and causal), without --torch (the rows are the
default where the Python can import torch), and checks
  - a PyTorch row follows each fp32 one-thread loom row of the table, with the same shape;
  - the --json "torch" rows are those shapes, with positive rates, each from the fastest of as
    many timed calls as loom's row (the backward timed by itself);
  - the rows timed both formulations of bench/torch_attention.py (PyTorch's own scaled dot product
    attention and the textbook one), alternated, as many calls each, and each kernel's rate is
    the faster formulation's fastest call, named in the row; the JSON and the table's
    "loom / PyTorch" line name PyTorch's scaled dot product attention;
  - each "loom / torch" target is loom's row rate over PyTorch's row rate, and "met" is
    value >= target;
and that by default a Python that cannot import torch is one "skipped" line, no PyTorch rows and
a zero exit; that with --torch a Python that cannot be run is one error and a non-zero exit
before any row; that GQA rows (--kv-heads below --heads) get no PyTorch rows (skipped by
default, refused with --torch); that --torch with --torch-json or --no-torch is refused; and that
bench/torch_compare.py runs each row with its own thread count's OpenBLAS pool (the one-thread
ring-step rows too) and writes its --json whole, - as standard output (the table then on
standard error) and /dev/stdout into a pipe after the table.
Nothing is timed against a threshold.
Exit 0 when all hold, else 1 with one line per failure.
"""
import json
import math
import os
import re
import subprocess
import sys


TORCH_COMPARE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench",
                             "torch_compare.py")


def check_torch_compare(python, work):
    """bench/torch_compare.py alone: each row ran with its own thread count's OpenBLAS pool (the
    one-thread ring-step rows ran in the first --threads entry's child, with its pool), and its
    --json is written whole, with no temporary left beside it."""
    bad = []
    out = os.path.join(work, "torch_compare.json")
    with open(out, "w") as f:
        f.write("old")
    r = subprocess.run([python, TORCH_COMPARE, "--seq", "64", "--dim", "32", "--heads", "1",
                        "--dtype", "fp32", "--threads", "2", "--mask", "full", "--ring", "32",
                        "--reps", "1", "--gemm-n", "32", "--impl", "textbook", "--json", out],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return [f"torch_compare.py exited {r.returncode}:\n{r.stdout}\n{r.stderr}"]
    rows = json.load(open(out))["results"]
    got = [(x["seq_q"], x["threads"], x.get("openblas_num_threads")) for x in rows]
    if sorted(got) != [(32, 1, "1"), (64, 2, "2")]:
        bad.append(f"torch_compare.py --threads 2 --ring 32: rows (seq, threads, the pool they ran "
                   f"with) {got} (want the 2-thread row with 2, the ring row with 1)")
    left = [x for x in os.listdir(work) if x.startswith("torch_compare.json.")]
    if left:
        bad.append(f"torch_compare.py left {left} beside its --json")
    # --json -: the JSON alone on standard output, the children's table on standard error (it
    # wrote a file named "-"); --json /dev/stdout into a pipe: the table, then the JSON (refused:
    # "cannot write in /proc/NNN/fd").
    tiny = [python, TORCH_COMPARE, "--seq", "32", "--dim", "16", "--heads", "1", "--dtype",
            "fp32", "--threads", "1", "--mask", "full", "--ring", "0", "--reps", "1", "--gemm-n",
            "32"]
    r = subprocess.run(tiny + ["--json", "-"], capture_output=True, text=True, timeout=300,
                       cwd=work)
    try:
        rows = json.loads(r.stdout)["results"]
    except (ValueError, KeyError):
        rows = None
    if r.returncode != 0 or not rows or "fwd ms" not in r.stderr or \
            os.path.exists(os.path.join(work, "-")):
        bad.append(f"torch_compare.py --json -: exit {r.returncode}, stdout {r.stdout[:300]!r}, "
                   f"stderr {r.stderr[-300:]!r} (want the JSON alone on stdout)")
    r = subprocess.run(tiny + ["--json", "/dev/stdout"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=300)
    head, brace, rest = r.stdout.partition("\n{")
    try:
        rows = json.loads(brace.strip() + rest)["results"] if brace else None
    except (ValueError, KeyError):
        rows = None
    if r.returncode != 0 or "fwd ms" not in head or not rows:
        bad.append(f"torch_compare.py --json /dev/stdout | cat: exit {r.returncode}, stdout "
                   f"{r.stdout[:300]!r}, stderr {r.stderr!r} (want the table, then the JSON)")
    return bad


def main():
    bench, python, work = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(work, exist_ok=True)
    out = os.path.join(work, "bench_torch.json")
    base = [bench, "--seq", "256", "--dim", "64", "--dtype", "fp32", "--ring", "0", "--threads",
            "1", "--min-time", "0.01", "--heads", "2", "--kv-heads", "2", "--gemm-n", "128",
            "--no-check"]
    r = subprocess.run(base + ["--torch-python", python, "--json", out],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        print(f"bench_kernels (PyTorch rows by default) exited {r.returncode}:\n{r.stdout}\n"
              f"{r.stderr}")
        return 1
    bad = []
    lines = r.stdout.splitlines()
    for mask in ("full", "causal"):
        pat = r"\s+256\s+256\s+2\s+2\s+64\s+" + mask + r"\s+1\s"
        idx = [i for i, x in enumerate(lines) if re.match(r"\s*fp32" + pat, x)]
        if len(idx) != 1:
            bad.append(f"{len(idx)} loom rows for the {mask} shape (want 1)")
        elif idx[0] + 1 >= len(lines) or not re.match(r"\s*torch" + pat, lines[idx[0] + 1]):
            bad.append(f"no PyTorch row right after loom's {mask} row")
    doc = json.load(open(out))
    loom_rows, torch_rows, targets = doc["results"], doc["torch"]["results"], doc["targets"]
    # PyTorch's own attention beside the textbook formulation: named at the top, on every row
    # and in the table.
    sdpa = "scaled_dot_product_attention"
    names = [doc["torch"].get("attention", "")] + [x.get("attention", "") for x in torch_rows]
    if not all(sdpa in n for n in names):
        bad.append(f"PyTorch's rows did not time its scaled dot product attention: {names}")
    if not [x for x in lines if x.startswith("loom / PyTorch ") and sdpa in x]:
        bad.append("no 'loom / PyTorch' line naming PyTorch's scaled dot product attention")
    for causal in (False, True):
        key = ("fp32", 256, 256, 64, causal, 1)
        lr = [x for x in loom_rows if (x["dtype"], x["seq_q"], x["seq_k"], x["dim"], x["causal"],
                                       x["threads"]) == key]
        tr = [x for x in torch_rows if (x["dtype"], x["seq_q"], x["seq_k"], x["dim"], x["causal"],
                                        x["threads"]) == key]
        if len(lr) != 1 or len(tr) != 1 or tr[0]["heads"] != 2:
            bad.append(f"{len(lr)} loom and {len(tr)} torch rows for {key} (want 1 each, 2 heads)")
            continue
        t = tr[0]
        if not (t["fwd_gflops"] > 0 and t["bwd_gflops"] > 0 and t["gemm_gflops"] > 0):
            bad.append(f"a PyTorch rate that is not positive: {t}")
        # As many timed calls as loom's forward took (bench_kernels passes --reps), the
        # backward timed alone: each rate is the useful FLOPs over the fastest of its own calls.
        calls = len(lr[0]["fwd_calls_s"])
        pairs = lr[0]["visible_pairs"]  # the same (query, key, head) triples on both sides
        forms = t.get("formulations", {})
        if sorted(forms) != ["sdpa", "textbook"]:
            bad.append(f"PyTorch formulations {sorted(forms)} (want sdpa and textbook)")
        for k, flops in (("fwd", 4.0 * 64 * pairs), ("bwd", 10.0 * 64 * pairs)):
            # each formulation as many calls as loom's row; the kernel's rate from the fastest
            fastest = min(forms.values(), key=lambda f: min(f[f"{k}_calls_s"], default=1e30),
                          default=None)
            if [len(f[f"{k}_calls_s"]) for f in forms.values()] != [calls] * len(forms):
                bad.append(f"PyTorch {k}: formulation call counts, want {calls} each")
            elif fastest is None or t[f"{k}_calls_s"] != fastest[f"{k}_calls_s"] or \
                    t.get(f"{k}_attention") != fastest["attention"]:
                bad.append(f"PyTorch {k}: the row's calls are not the faster formulation's")
            ts = t.get(f"{k}_calls_s", [])
            if len(ts) != calls or min(ts, default=0) <= 0:
                bad.append(f"PyTorch {k} calls {ts} (want {calls} positive times, as loom's row)")
            elif not (math.isclose(t[f"{k}_s"], min(ts), rel_tol=1e-12) and
                      math.isclose(t[f"{k}_gflops"], flops / min(ts) * 1e-9, rel_tol=1e-9)):
                bad.append(f"PyTorch {k}: {t[f'{k}_s']} s, {t[f'{k}_gflops']} GFLOP/s, but its "
                           f"fastest call {min(ts)} s gives {flops / min(ts) * 1e-9}")
        tag = f" fp32 Sq=256 H=2 D=64 {'causal' if causal else 'full'} 1 thr"
        kinds = ("fwd",) if causal else ("fwd", "bwd")
        for k in kinds:
            hits = [x for x in targets if x["what"] == f"loom / torch {k}," + tag]
            if len(hits) != 1:
                bad.append(f"{len(hits)} 'loom / torch {k},{tag}' lines (want 1)")
                continue
            want = lr[0][f"{k}_gflops"] / t[f"{k}_gflops"]
            if not math.isclose(hits[0]["value"], want, rel_tol=1e-9):
                bad.append(f"'loom / torch {k},{tag}': {hits[0]['value']}, its rows give {want}")
            if hits[0]["met"] != (hits[0]["value"] >= hits[0]["target"]):
                bad.append(f"'loom / torch {k},{tag}': met is {hits[0]['met']}")

    # A Python that cannot run: one error line naming it, a non-zero exit, before anything is
    # timed (it failed after loom's first row).
    nopy = os.path.join(work, "no-such-python")
    r = subprocess.run(base + ["--torch", "--torch-python", nopy],
                       capture_output=True, text=True, timeout=120)
    err = r.stderr.strip().splitlines()
    if (r.returncode == 0 or len(err) != 1 or not err[0].startswith("bench_kernels: --torch: ")
            or nopy not in err[0] or re.search(r"^\s*fp32\s", r.stdout, re.M)):
        bad.append(f"a missing Python: exit {r.returncode}, stdout {r.stdout!r}, stderr "
                   f"{r.stderr!r} (want one line naming it, before any row)")
    # GQA: PyTorch's rows run every head's own k and v, another shape than loom's GQA rows. By
    # default they are skipped, saying why; --torch refuses before anything runs.
    gqa = [x if x != "2" or base[i - 1] != "--kv-heads" else "1" for i, x in enumerate(base)]
    out3 = os.path.join(work, "bench_gqa.json")
    r = subprocess.run(gqa + ["--torch-python", python, "--json", out3], capture_output=True,
                       text=True, timeout=300)
    skips = [x for x in r.stdout.splitlines() if x.startswith("PyTorch rows: skipped")]
    if r.returncode != 0 or len(skips) != 1 or "GQA" not in skips[0] or \
            re.search(r"^\s*torch\s", r.stdout, re.M) or "torch" in json.load(open(out3)):
        bad.append(f"--kv-heads 1 --heads 2 by default: exit {r.returncode}, stdout {r.stdout!r} "
                   "(want PyTorch's rows skipped, saying why)")
    r = subprocess.run(gqa + ["--torch", "--torch-python", python], capture_output=True,
                       text=True, timeout=120)
    if r.returncode == 0 or "--kv-heads" not in r.stderr or r.stdout:
        bad.append(f"--torch --kv-heads 1 --heads 2: exit {r.returncode}, stdout {r.stdout!r}, "
                   f"stderr {r.stderr!r} (want a refusal before anything runs)")
    bad += check_torch_compare(python, work)
    # The default with a Python that cannot import torch: skipped, said once, exit 0.
    notorch = os.path.join(work, "python-without-torch")
    with open(notorch, "w") as f:
        f.write("#!/bin/sh\necho 'No module named torch' >&2\nexit 1\n")
    os.chmod(notorch, 0o755)
    out2 = os.path.join(work, "bench_notorch.json")
    r = subprocess.run(base + ["--torch-python", notorch, "--json", out2], capture_output=True,
                       text=True, timeout=120)
    skips = [x for x in r.stdout.splitlines() if x.startswith("PyTorch rows: skipped")]
    if r.returncode != 0 or len(skips) != 1 or notorch not in skips[0]:
        bad.append(f"a Python without torch by default: exit {r.returncode}, stdout {r.stdout!r}")
    elif re.search(r"^\s*torch\s", r.stdout, re.M) or "torch" in json.load(open(out2)):
        bad.append("PyTorch rows although the Python cannot import torch")
    for other in (["--torch-json", out], ["--no-torch"]):
        r = subprocess.run(base + ["--torch"] + other, capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            bad.append(f"--torch with {other[0]} was accepted")
    if bad:
        print("\n".join(bad))
        return 1
    print(f"bench_kernels --torch: {len(torch_rows)} PyTorch rows, ratios consistent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
