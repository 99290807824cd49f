#!/usr/bin/python3
"""PyTorch (CPU) attention on the shapes of bench_kernels, for a side-by-side comparison.

Needs Debian's python3-torch (1.13, `apt-get install python3-torch`) run with /usr/bin/python3.
It times PyTorch attention, eager (autograd for the backward), in [H, S, D] layout, in the
formulations of bench/torch_attention.py: PyTorch's own scaled dot product attention (sdpa, which
PyTorch 1.13 materialises on CPU) and the textbook one (the scale applied to the S x S scores),
each first checked against an fp64 softmax(q k^T / sqrt(D)) v on small shapes (a failed check
exits 1). By default (--impl best) both run, alternated call by call (the order reversed every
round), and each kernel reports the formulation whose fastest call was fastest: loom is compared
with the best PyTorch of the two, forward and backward separately. --impl sdpa or textbook times
one alone (the textbook one alone is what this script timed before 2026-12-04).
It reports the same useful FLOP counts as bench_kernels: forward 4 * D * visible pairs, backward
2.5x that; causal counts only the S (S + 1) / 2 visible pairs per head. Each measurement is the
best of --reps calls after one warm-up; the backward is timed alone, each call on the graph of an
untimed forward. Next to it, torch.mm's fp32 GEMM rate (M = N = K = --gemm-n) with the same
threads.

  /usr/bin/python3 bench/torch_compare.py                       # default sweep, a table
  /usr/bin/python3 bench/torch_compare.py --seq 4096 --dim 128 --threads 1 --json torch.json

`bench_kernels --torch` runs this script itself, one shape at a time right after loom's row
(--mask full or causal, --ring 0), so that both sides of each ratio come from the same minute.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_attention  # noqa: E402  (bench/torch_attention.py, beside this script)
import validate_common  # noqa: E402  (bench/validate_common.py: its command line and --json)

# Debian's torch does its matrix products in OpenBLAS, whose thread pool follows
# OPENBLAS_NUM_THREADS / OMP_NUM_THREADS read at load time, not torch.set_num_threads. So each
# thread count runs in its own child process with those set (--child marks a child), and the
# one-thread ring-step rows in a one-thread child (--ring-only where no --threads entry is 1).


# --threads: at most this many times the CPUs the script may run on. More only oversubscribes
# them (and times the oversubscription): --threads 5000 ran for minutes, --threads 100000 crashed
# OpenBLAS in the child (SIGSEGV), and the parent printed nothing.
THREADS_PER_CPU = 4
# Bytes per visible-or-not score of the largest row's attention, at its peak (the backward of the
# eager formulations holds the fp32 scores, their softmax and the gradients of both, H x Sq x Sk
# each: measured 3.2-4.1x of one such tensor at S = 1024-4096), and what torch itself takes.
ATTENTION_BYTES_PER_SCORE = 16
TORCH_BASE_BYTES = 512 << 20


def cpu_count():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def available_memory():
    """Bytes this process may still allocate: MemAvailable (/proc/meminfo), or less under a
    cgroup v2 limit (memory.max - memory.current); None where neither can be read."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            left = max(0, int(limit) - used)
            avail = left if avail is None else min(avail, left)
    except (OSError, ValueError):
        pass
    return avail


def check_sizes(ap, args):
    """Refuses (one line, exit 2) before anything runs a --threads beyond THREADS_PER_CPU x the
    CPUs, and a --seq / --ring / --gemm-n whose tensors cannot fit in the memory available (each
    child holds one row's at a time: a huge --seq or --gemm-n ended in a RuntimeError traceback
    after the earlier rows had run)."""
    cpus = cpu_count()
    most = THREADS_PER_CPU * cpus
    for t in args.threads:
        if t > most:
            ap.error(f"--threads {t}: at most {most} ({THREADS_PER_CPU} x the {cpus} CPUs this "
                     "process may run on; more threads only oversubscribe them)")
    avail = available_memory()
    if avail is None:
        return
    gib = 1 << 30
    seqs = ([] if args.ring_only else [("--seq", s) for s in args.seq]) + (
        [("--ring", args.ring)] if args.ring > 0 else [])
    needs = [(f"{option} {s}", ATTENTION_BYTES_PER_SCORE * args.heads * s * s,
              f"PyTorch's eager attention holds about 4 fp32 --heads x S x S tensors ({args.heads} "
              f"x {s} x {s})") for option, s in seqs]
    needs.append((f"--gemm-n {args.gemm_n}", 12 * args.gemm_n ** 2,
                  f"torch.mm's 3 fp32 {args.gemm_n} x {args.gemm_n} matrices"))
    for option, need, what in needs:
        if need + TORCH_BASE_BYTES > avail:
            ap.error(f"{option}: needs about {(need + TORCH_BASE_BYTES) / gib:.1f} GiB ({what}), "
                     f"more than the {avail / gib:.1f} GiB of memory available; lower it")


def alternated_times(fns, reps, setup=None):
    """{name: seconds of reps timed calls} of the named fns, after one warm-up each: round i calls
    every fn once, in order on even rounds and reversed on odd ones, each after an untimed
    setup(name), so that each formulation sees the same seconds of a drifting machine."""
    names = list(fns)
    times = {n: [] for n in names}
    for i in range(reps + 1):
        for n in (names if i % 2 == 0 else names[::-1]):
            if setup is not None:
                setup(n)
            t0 = time.perf_counter()
            fns[n]()
            if i > 0:
                times[n].append(time.perf_counter() - t0)
    return times


def best_time(fn, reps):
    return min(alternated_times({"fn": fn}, reps)["fn"])


def main():
    ap = validate_common.ArgumentParser(description=__doc__.splitlines()[0])
    positive = validate_common.int_at_least(1)
    ap.add_argument("--seq", type=positive, nargs="+", default=[4096])
    ap.add_argument("--dim", type=positive, nargs="+", default=[64, 128])
    ap.add_argument("--heads", type=positive, default=8)
    ap.add_argument("--dtype", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    ap.add_argument("--threads", type=positive, nargs="+", default=[1, 2])
    ap.add_argument("--mask", choices=["full", "causal", "both"], default="both")
    ap.add_argument("--ring", type=validate_common.int_at_least(0), default=512,
                    help="ring-step rows, one thread (0: none)")
    ap.add_argument("--reps", type=positive, default=3)
    ap.add_argument("--gemm-n", type=positive, default=1024)
    ap.add_argument("--impl", choices=("best",) + torch_attention.IMPLS, default="best",
                    help="PyTorch formulation(s) to time (bench/torch_attention.py); best: all, "
                         "alternated, each kernel reporting its fastest")
    ap.add_argument("--json", default="",
                    help="also write the rows as JSON: - is standard output (the table then goes to "
                         "standard error), /dev/stdout, a device or a FIFO are written in place, a "
                         "file atomically")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ring-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-header", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for key in ("seq", "dim", "dtype", "threads"):  # each value once, in the order given
        setattr(args, key, list(dict.fromkeys(getattr(args, key))))
    check_sizes(ap, args)
    validate_common.check_output(ap, args.json)  # before the run, not after it
    if not args.child:
        # Each thread count's rows in a child with that count's OpenBLAS / OpenMP environment;
        # the ring-step rows (one thread) in a one-thread child: they ran in the first count's
        # child, whose BLAS ran that many threads under rows labelled "1 thr".
        children = [(t, args.ring if t == 1 else 0, False) for t in args.threads]
        if args.ring > 0 and 1 not in args.threads:
            children.append((1, args.ring, True))
        rows, version, impl = [], None, None
        for i, (t, ring, ring_only) in enumerate(children):
            env = dict(os.environ, OPENBLAS_NUM_THREADS=str(t), OMP_NUM_THREADS=str(t))
            fd, out = tempfile.mkstemp(prefix="torch_compare_", suffix=".json")
            os.close(fd)
            cmd = [sys.executable, __file__, "--child", "--threads", str(t), "--json", out,
                   "--seq", *map(str, args.seq), "--dim", *map(str, args.dim),
                   "--heads", str(args.heads), "--dtype", *args.dtype, "--mask", args.mask,
                   "--ring", str(ring), "--reps", str(args.reps),
                   "--gemm-n", str(args.gemm_n), "--impl", args.impl]
            if i > 0:
                cmd.append("--no-header")
            if ring_only:
                cmd.append("--ring-only")
            try:
                rc = subprocess.call(cmd, env=env)
                if rc < 0:  # killed by a signal: it said nothing, and exit status -N was 256 - N
                    try:
                        name = signal.Signals(-rc).name
                    except ValueError:
                        name = f"signal {-rc}"
                    print(f"torch_compare: the child for --threads {t} was killed by {name}",
                          file=sys.stderr)
                    return 1
                if rc != 0:
                    return rc
                with open(out) as f:
                    got = json.load(f)
            finally:
                os.remove(out)
            rows += got["results"]
            version, impl = got["torch"], got["attention"]
        if args.json:
            validate_common.write_json(args.json,
                                       {"torch": version, "attention": impl, "results": rows})
        return 0
    try:
        import torch
    except ImportError:
        print("torch_compare: PyTorch is not installed (apt-get install python3-torch)",
              file=sys.stderr)
        return 2

    impls = torch_attention.IMPLS if args.impl == "best" else (args.impl,)
    errs = {}
    for name in impls:
        err, case = torch_attention.check(name)
        if not err <= 1e-5:
            print(f"torch_compare: PyTorch's attention ({name}) is off the fp64 reference: "
                  f"relative error {err:.3g} > 1e-5 at {case}", file=sys.stderr)
            return 1
        errs[name] = err
    names = {name: torch_attention.describe(name) for name in impls}
    impl = (names[impls[0]] if len(impls) == 1 else
            "per kernel the faster of " + " and ".join(names.values()))
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if not args.no_header:
        checked = ", ".join(f"{n} {e:.2g}" for n, e in errs.items())
        print(f"torch {torch.__version__}, {impl} (checked against fp64, relative error: "
              f"{checked})")
        print(f"{'dtype':>5} {'Sq':>6} {'Sk':>6} {'H':>3} {'D':>4} {'mask':>6} {'thr':>3} "
              f"{'sgemm':>7} | {'fwd ms':>9} {'GFLOP/s':>8} {'/gemm':>6} | {'bwd ms':>9} "
              f"{'GFLOP/s':>8} {'/gemm':>6}", flush=True)
    rows = []
    gemm_cache = {}

    def gemm_rate(threads):
        if threads not in gemm_cache:
            torch.set_num_threads(threads)
            a = torch.randn(args.gemm_n, args.gemm_n)
            b = torch.randn(args.gemm_n, args.gemm_n)
            t = best_time(lambda: torch.mm(a, b), args.reps)
            gemm_cache[threads] = 2.0 * args.gemm_n ** 3 / t * 1e-9
        return gemm_cache[threads]

    def run(dtype, sq, sk, d, causal, threads):
        torch.set_num_threads(threads)
        gemm = gemm_rate(threads)
        torch.set_num_threads(threads)
        h = args.heads
        g = torch.Generator().manual_seed(1)
        q = torch.randn(h, sq, d, generator=g).to(dtypes[dtype]).requires_grad_()
        k = torch.randn(h, sk, d, generator=g).to(dtypes[dtype]).requires_grad_()
        v = torch.randn(h, sk, d, generator=g).to(dtypes[dtype]).requires_grad_()
        dout = torch.randn(h, sq, d, generator=g).to(dtypes[dtype])
        # causal: queries at positions [sk - sq, sk), keys at [0, sk)
        pairs = (sq * sk if not causal else
                 sum(max(0, min(sk, sk - sq + i + 1)) for i in range(sq))) * h

        def forward(name):
            return torch_attention.attention(q, k, v, causal, name)

        def fwd_only(name):
            with torch.no_grad():
                forward(name)

        # The backward alone, as bench_kernels times loom's: each timed backward runs on the graph
        # of an untimed forward (the best of one call, not a difference of two bests).
        graph = []

        def fwd_with_graph(name):
            q.grad = k.grad = v.grad = None
            graph[:] = [forward(name)]

        def bwd_only():
            graph.pop().backward(dout)

        fwd_calls = alternated_times({n: (lambda n=n: fwd_only(n)) for n in impls}, args.reps)
        bwd_calls = alternated_times({n: bwd_only for n in impls}, args.reps,
                                     setup=fwd_with_graph)
        fwd_best = min(impls, key=lambda n: min(fwd_calls[n]))
        bwd_best = min(impls, key=lambda n: min(bwd_calls[n]))
        t_fwd, t_bwd = min(fwd_calls[fwd_best]), min(bwd_calls[bwd_best])
        flops = 4.0 * d * pairs
        r = dict(dtype=dtype, seq_q=sq, seq_k=sk, heads=h, dim=d, causal=causal, threads=threads,
                 attention=impl, fwd_attention=names[fwd_best], bwd_attention=names[bwd_best],
                 gemm_gflops=gemm, fwd_s=t_fwd, bwd_s=t_bwd, fwd_gflops=flops / t_fwd * 1e-9,
                 bwd_gflops=2.5 * flops / t_bwd * 1e-9, fwd_calls_s=fwd_calls[fwd_best],
                 bwd_calls_s=bwd_calls[bwd_best],
                 # the BLAS pool this row ran with (the parent sets it per child: see above)
                 openblas_num_threads=os.environ.get("OPENBLAS_NUM_THREADS"),
                 formulations={n: dict(attention=names[n], fwd_calls_s=fwd_calls[n],
                                       bwd_calls_s=bwd_calls[n]) for n in impls})
        which = "" if len(impls) == 1 else f"   fastest: fwd {fwd_best}, bwd {bwd_best}"
        print(f"{dtype:>5} {sq:>6} {sk:>6} {h:>3} {d:>4} {'causal' if causal else 'full':>6} "
              f"{threads:>3} {gemm:>7.1f} | {t_fwd * 1e3:>9.1f} {r['fwd_gflops']:>8.1f} "
              f"{r['fwd_gflops'] / gemm:>6.2f} | {t_bwd * 1e3:>9.1f} {r['bwd_gflops']:>8.1f} "
              f"{r['bwd_gflops'] / gemm:>6.2f}{which}", flush=True)
        rows.append(r)

    try:
        for dtype in args.dtype if not args.ring_only else ():
            for s in args.seq:
                for d in args.dim:
                    for causal in {"full": (False,), "causal": (True,),
                                   "both": (False, True)}[args.mask]:
                        for threads in args.threads:
                            run(dtype, s, s, d, causal, threads)
        if args.ring > 0:
            for dtype in args.dtype:
                for d in args.dim:
                    run(dtype, args.ring, args.ring, d, False, 1)
    except (MemoryError, RuntimeError) as e:
        # What check_sizes' estimate let through (other processes took the memory meanwhile):
        # one line, not torch's traceback.
        if not isinstance(e, MemoryError) and "alloc" not in str(e):
            raise
        print(f"torch_compare: out of memory ({str(e).splitlines()[0] if str(e) else 'MemoryError'}"
              "); lower --seq, --heads or --gemm-n", file=sys.stderr)
        return 1
    if args.json:
        validate_common.write_json(args.json,
                                   {"torch": torch.__version__, "attention": impl, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
