#!/usr/bin/python3
"""loom.torch binding benchmarks (issue 13): what calling loom through PyTorch costs.

  1. overhead   per-call cost of the binding at tiny shapes (S = 8, H = 1, D = 16): the
                autograd op loom.torch.attention against the bare C++ entry (_loom), and a
                trivial torch op (x + 1) for the price of one torch dispatch, forward and
                forward + backward;
  2. vs-torch   loom.torch.attention against PyTorch's own attention, eager (its scaled dot
                product attention through bench/torch_attention.py, autograd backward; GQA by
                repeating k and v) on one process, S = --seq;
  3. vs-loom    the same context-parallel attention through torch and through the loom
                command, S = --seq tokens per rank: 1 process (loom.torch.attention and
                loom.torch.cp_attention over a 1-rank gloo group vs `loom attn --ranks 1`)
                and 2 processes (loom.torch.cp_attention under loom.torchrun, gloo, vs
                `mpirun -np 2 loom attn`, MPI), ring / zigzag, causal, fp32, 1 thread per rank;
                and the 2-process scaling: the same global 2 * --seq tokens on 1 and 2 processes.

Every figure is the median of --iters timed calls after --warmup; ratios are formed in the same
run. Every operation this script times through torch (loom.torch.attention, cp_attention over 1
and 2 ranks, the bare C++ forward, torch's eager attention) is first checked, forward and
backward (out, dq, dk, dv through autograd), against loom's fp64 reference on the first
--check-seq tokens of the timed inputs (the tiny shapes whole), within loom's fp32 tolerance 1e-5
(relative norm; kFp32RelTol, tests/unit/tolerance.h): a mismatch is one line naming the tensor and
exit status 1, before anything of it is timed. The `loom attn` rows are loom's command, checked by
its own tests (its --check would cost more than the run here). Bad values are one line and exit 2
before anything runs; a failed child (`loom attn`, the torchrun workers) is one line with its own
error and exit 1.

  PYTHONPATH=build/python /usr/bin/python3 bench/bench_torch_binding.py [--seq 4096] [--json f]
"""
import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import torch_attention  # noqa: E402  (bench/torch_attention.py)
import validate_common  # noqa: E402  (bench/validate_common.py: its command line and --json)


PROG = "bench_torch_binding.py"
FP32_REL_TOL = 1e-5  # loom's fp32 tolerance (kFp32RelTol): out, dq, dk and dv alike
MAX_HEAD_DIM = 256  # loom's kernels: a head dim above it was an InvalidArgument traceback


def fail(message):
    """One line on stderr and exit status 1 (a failed check or child: not a traceback, and not an
    assert, which python -O removes)."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def check_op(what, op, q, k, v, check_seq, group=None):
    """Checks op(q, k, v) -- its out, and dq, dk, dv through autograd for a seeded dout -- on the
    first check_seq tokens of the [1, S, H, D] inputs against loom's fp64 reference, within
    FP32_REL_TOL (relative norm over the whole tensor; NaN or Inf fails). With group, op is
    cp_attention on this rank's zigzag shard: the inputs and the reference are sharded, the
    squared norms summed over the ranks (every rank gets the same verdict, and rank 0 prints it).
    A mismatch is one line and exit 1; check_seq 0 checks nothing."""
    import torch
    import torch.distributed as dist
    import loom.torch as lt
    if not check_seq:
        return
    qc, kc, vc = (x[:, :check_seq].contiguous() for x in (q, k, v))
    dout = torch.randn(qc.shape, generator=torch.Generator().manual_seed(7))
    q64, k64, v64 = (x.double().requires_grad_() for x in (qc, kc, vc))
    ref = lt.reference_attention(q64, k64, v64)
    ref.backward(dout.double())
    refs = {"out": ref.detach(), "dq": q64.grad, "dk": k64.grad, "dv": v64.grad}
    if group is not None:
        qc, kc, vc, dout = (lt.shard(x, group=group) for x in (qc, kc, vc, dout))
        refs = {name: lt.shard(r, group=group) for name, r in refs.items()}
    qg, kg, vg = (x.clone().requires_grad_() for x in (qc, kc, vc))
    out = op(qg, kg, vg)
    out.backward(dout)
    got = {"out": out.detach(), "dq": qg.grad, "dk": kg.grad, "dv": vg.grad}
    sums = torch.tensor([[((got[n].double() - refs[n]) ** 2).sum().item(),
                          (refs[n] ** 2).sum().item()] for n in refs], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(sums, group=group)
    for n, (diff, norm) in zip(refs, sums.tolist()):
        err = math.sqrt(diff / norm) if norm > 0 else math.sqrt(diff)
        if not err <= FP32_REL_TOL:  # NaN fails too
            if group is None or dist.get_rank(group) == 0:
                fail(f"{what}: {n} is off loom's fp64 reference by {err:.3g} (relative norm over "
                     f"the first {check_seq} tokens; limit {FP32_REL_TOL:g}): not timed")
            sys.exit(1)


def run_child(cmd, what, env=None):
    """Runs a child (stdout and stderr captured); a failure is one line naming `what`, with the
    child's own error lines (its lines from this script, else the last of its output), exit 1.
    A child killed by a signal is named so."""
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       errors="replace")
    if r.returncode == 0:
        return
    how = (f"killed by signal {-r.returncode}" if r.returncode < 0
           else f"exit status {r.returncode}")
    fail(f"{what} failed ({how}): " + " | ".join(child_error(r.stdout)))


def child_error(output):
    """The lines of a failed child's output that say why: this script's own error lines (a
    worker's failed check), else the exception that ended the first traceback (torchrun's own
    report of the failed worker and its ChildFailedError traceback follow it and say nothing
    more), else its last three lines."""
    lines = [l.strip() for l in output.splitlines() if l.strip()]
    own = list(dict.fromkeys(l for l in lines if l.startswith(PROG + ":")))
    if own:
        return own[:3]
    raw = output.splitlines()
    for i, line in enumerate(raw):
        if line.startswith("Traceback (most recent call last):"):
            for after in raw[i + 1:]:
                if after.strip() and not after[0].isspace():
                    return [after.strip()]
    return lines[-3:] or ["(no output)"]


def median_time(fn, iters, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def eager(q, k, v, causal):
    """PyTorch's own attention on [B, S, H, D] q and [B, S, Hkv, D] k, v (bench/torch_attention.py:
    its scaled dot product attention), k and v repeated to the query heads."""
    g = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(g, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(g, dim=2).transpose(1, 2)
    return torch_attention.attention(qh, kh, vh, causal).transpose(1, 2)


def fwd_bwd_times(op, q, k, v, iters, warmup):
    """(forward s, backward s) of op(q, k, v) through autograd."""
    import torch
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    holder = {}

    def fwd():
        holder["out"] = op(qg, kg, vg)

    def bwd():
        holder["out"].backward(dout)

    for _ in range(warmup):
        fwd()
        bwd()
    tf, tb = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        fwd()
        t1 = time.perf_counter()
        bwd()
        t2 = time.perf_counter()
        tf.append(t1 - t0)
        tb.append(t2 - t1)
    return statistics.median(tf), statistics.median(tb)


def inputs(s, heads, kv_heads, dim, seed=1):
    import torch
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, s, heads, dim, generator=gen)
    k = torch.randn(1, s, kv_heads, dim, generator=gen)
    v = torch.randn(1, s, kv_heads, dim, generator=gen)
    return q, k, v


def loom_attn(ranks_args, args, s_global):
    """forward_s, backward_s of the loom command (its JSON report)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "r.json")
        cmd = ranks_args + [os.path.join(args.build, "loom"), "attn", "--strategy", "ring",
                            "--layout", "zigzag", "--seq", str(s_global), "--heads",
                            str(args.heads), "--kv-heads", str(args.kv_heads), "--head-dim",
                            str(args.dim), "--threads", "1", "--iters", str(args.iters),
                            "--warmup", str(args.warmup), "--backward", "--quiet", "--json", path]
        if not ranks_args:
            cmd += ["--ranks", "1"]
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1")
        run_child(cmd, "`" + " ".join(cmd[:len(ranks_args) + 2]) + "`", env=env)
        with open(path) as f:
            rep = json.load(f)
        return rep["forward_s"], rep["backward_s"]


def worker(args):
    """Under loom.torchrun: cp_attention on this rank's shard of 2-process problems."""
    import torch
    import torch.distributed as dist
    import loom.torch as lt
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    p = dist.get_world_size()
    s_global = args.seq * p
    q, k, v = inputs(s_global, args.heads, args.kv_heads, args.dim)
    # check first, forward and backward: this rank's shard against the fp64 reference's
    group = dist.distributed_c10d._get_default_group()
    check_op(f"cp_attention over {p} processes", lambda a, b, c: lt.cp_attention(a, b, c), q, k, v,
             args.check_seq, group=group)
    qs, ks, vs = (lt.shard(x) for x in (q, k, v))
    tf, tb = fwd_bwd_times(lambda a, b, c: lt.cp_attention(a, b, c), qs, ks, vs, args.iters,
                           args.warmup)
    # slowest rank, as loom attn reports
    t = torch.tensor([tf, tb], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"forward_s": t[0].item(), "backward_s": t[1].item()}, f)
    dist.destroy_process_group()


def alternate(args):
    """Minimum forward / backward time of each side over N alternating runs: the binding's cost
    at S = --seq on one process, with load from other jobs falling on both sides alike."""
    import torch
    import torch.distributed as dist
    import loom.torch as lt
    torch.set_num_threads(1)
    q, k, v = inputs(args.seq, args.heads, args.kv_heads, args.dim)
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    best = {"torch_f": [], "torch_b": [], "attn_f": [], "attn_b": []}
    # The scale passed to both, explicitly: the op is cached by its arguments, and args.dim **
    # -0.5 is one ulp off cp_attention's default 1 / sqrt(D) for 52 head dims (32, 48, 96, 128,
    # ...), so the op held here was another one, which never ran (a division by its 0 s).
    scale = 1.0 / math.sqrt(args.dim)

    def cp(a, b, c):
        return lt.cp_attention(a, b, c, group=pg, scale=scale)

    check_op("cp_attention over a 1-rank group", cp, q, k, v, args.check_seq)
    # Same call, same load: the Python call's wall time over the engine's own time inside it
    # (CpAttention::forward / backward, timed in C++). This is exactly what the binding adds.
    g = lt._group(pg)
    op = g.op("ring", "zigzag", 1, 0, True, 0, scale, 1, args.seq, args.heads,
              args.kv_heads, args.dim, False, [], q, k, v, False)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    dout = torch.randn(q.shape)
    inner = {"f": [], "b": []}
    for _ in range(args.iters + 1):
        t0 = time.perf_counter()
        out = cp(qg, kg, vg)
        t1 = time.perf_counter()
        out.backward(dout)
        t2 = time.perf_counter()
        if not (op.last_forward_s > 0 and op.last_backward_s > 0):
            fail("the engine op timed here is not the one cp_attention ran (its time is 0 s): "
                 "the two were built with different arguments")
        inner["f"].append((t1 - t0) / op.last_forward_s)
        inner["b"].append((t2 - t1) / op.last_backward_s)
    fi, bi = statistics.median(inner["f"][1:]), statistics.median(inner["b"][1:])
    for _ in range(args.alternate):
        f, b = fwd_bwd_times(cp, q, k, v, args.iters, args.warmup)
        best["torch_f"].append(f)
        best["torch_b"].append(b)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "r.json")
            run_child([os.path.join(args.build, "loom"), "attn", "--ranks", "1", "--seq",
                       str(args.seq), "--heads", str(args.heads), "--kv-heads",
                       str(args.kv_heads), "--head-dim", str(args.dim), "--threads", "1",
                       "--iters", str(args.iters), "--warmup", str(args.warmup),
                       "--backward", "--quiet", "--json", path],
                      "`loom attn --ranks 1`", env=dict(os.environ, OMP_NUM_THREADS="1"))
            with open(path) as f_:
                rep = json.load(f_)
            best["attn_f"].append(min(rep["forward_times_s"]))
            best["attn_b"].append(min(rep["backward_times_s"]))
    tf, tb = min(best["torch_f"]), min(best["torch_b"])
    af, ab = min(best["attn_f"]), min(best["attn_b"])
    print(f"S={args.seq} H={args.heads} HKV={args.kv_heads} D={args.dim}, 1 process, 1 thread, "
          f"minimum over {args.alternate} alternating runs x {args.iters} calls:")
    print(f"  forward   loom.torch.cp_attention {tf * 1e3:8.1f} ms   loom attn {af * 1e3:8.1f} ms"
          f"   ratio {tf / af:.3f}")
    print(f"  backward  loom.torch.cp_attention {tb * 1e3:8.1f} ms   loom attn {ab * 1e3:8.1f} ms"
          f"   ratio {tb / ab:.3f}")
    print(f"  same call: Python wall time / engine time inside it: forward {fi:.4f}, "
          f"backward {bi:.4f} (median of {args.iters})")
    if args.json:
        validate_common.write_json(
            args.json, {"wall_over_engine_forward": fi, "wall_over_engine_backward": bi,
                        "torch_forward_s": best["torch_f"], "torch_backward_s": best["torch_b"],
                        "loom_attn_forward_s": best["attn_f"],
                        "loom_attn_backward_s": best["attn_b"]}, indent=1)


def main():
    # Every value checked here, before anything runs (--iters 0 ended in a StatisticsError,
    # --build /nonexistent in a FileNotFoundError after parts 1 and 2 had run, --check-seq 0 in
    # a division by a zero norm).
    ap = validate_common.ArgumentParser(description=__doc__.splitlines()[0])
    positive = validate_common.int_at_least(1)
    ap.add_argument("--seq", type=positive, default=4096, help="tokens per rank")
    ap.add_argument("--heads", type=positive, default=8)
    ap.add_argument("--kv-heads", type=positive, default=2, help="divides --heads")
    ap.add_argument("--dim", type=positive, default=64)
    ap.add_argument("--iters", type=positive, default=5)
    ap.add_argument("--warmup", type=validate_common.int_at_least(0), default=1)
    ap.add_argument("--tiny-iters", type=validate_common.int_at_least(4), default=2000,
                    help="calls of each tiny-shape measurement (forward + backward: a quarter)")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"),
                    help="the build directory holding the loom command")
    ap.add_argument("--check-seq", type=validate_common.int_at_least(0), default=300,
                    help="length of the correctness check (0: no check)")
    ap.add_argument("--json", help="write the figures as JSON: - is standard output (the text then "
                                    "goes to standard error), /dev/stdout, a device or a FIFO "
                                    "are written in place, a file atomically")
    ap.add_argument("--alternate", type=validate_common.int_at_least(0), default=0,
                    help="only the 1-process binding cost: N alternating runs of `loom attn "
                         "--ranks 1` and cp_attention over a 1-rank group, minimum of each (robust "
                         "on a loaded machine)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.dim > MAX_HEAD_DIM:  # was an InvalidArgument traceback after part 1 had run
        ap.error(f"--dim {args.dim}: loom's kernels take a head dim of at most {MAX_HEAD_DIM}")
    validate_common.check_output(ap, args.json)
    loom = os.path.join(args.build, "loom")
    if not (os.path.isfile(loom) and os.access(loom, os.X_OK)):
        ap.error(f"--build {args.build}: no loom command in it (build the loom target there)")
    if not args.alternate and shutil.which("mpirun") is None:
        ap.error("part 3 runs `mpirun -np 2 loom attn`, but no mpirun is on PATH (--alternate N "
                 "times the 1-process binding cost alone)")

    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch
        import torch.distributed as dist
        import loom.torch as lt
        from loom import _loom
    except ImportError as e:
        ap.error(f"cannot import torch and loom.torch ({e}; PYTHONPATH=build/python)")
    torch.set_num_threads(1)
    if args.alternate:
        return alternate(args)
    res = {"seq_per_rank": args.seq, "heads": args.heads, "kv_heads": args.kv_heads,
           "dim": args.dim, "threads_per_rank": 1, "kernel_path": _loom.kernel_path()}

    # 1. overhead at tiny shapes, each timed operation checked first (the whole 8 tokens)
    q, k, v = inputs(8, 1, 1, 16)
    x = torch.randn(8, 1, 16)
    n = args.tiny_iters
    check_op("loom.torch.attention (tiny shapes)", lt.attention, q, k, v, 8)
    check_op("torch eager attention (tiny shapes)", lambda a, b, c: eager(a, b, c, True),
             q, k, v, 8)
    bare_out, _ = _loom.attention_forward(q, k, v, 1, 8, [], 1, 1, 16, True, 0, 0.25, False, False)
    ref = lt.reference_attention(q, k, v)
    err = ((bare_out.reshape(ref.shape).double() - ref).norm() / ref.norm()).item()
    if not err <= FP32_REL_TOL:
        fail(f"_loom.attention_forward (tiny shapes): out is off loom's fp64 reference by "
             f"{err:.3g} (limit {FP32_REL_TOL:g}): not timed")
    bare = median_time(
        lambda: _loom.attention_forward(q, k, v, 1, 8, [], 1, 1, 16, True, 0, 0.25, False, False), n, 50)
    op = median_time(lambda: lt.attention(q, k, v), n, 50)
    add = median_time(lambda: x + 1, n, 50)
    qg = q.clone().requires_grad_()
    fb = median_time(lambda: lt.attention(qg, k, v).sum().backward(), n // 4, 20)
    fb_eager = median_time(lambda: eager(qg, k, v, True).sum().backward(), n // 4, 20)
    res["tiny"] = {"bare_forward_us": bare * 1e6, "op_forward_us": op * 1e6,
                   "torch_add_us": add * 1e6, "op_forward_backward_us": fb * 1e6,
                   "eager_forward_backward_us": fb_eager * 1e6}

    # 2. vs plain torch on one process, S = --seq
    s = args.seq
    q, k, v = inputs(s, args.heads, args.kv_heads, args.dim)
    check_op("loom.torch.attention", lt.attention, q, k, v, args.check_seq)
    check_op("torch eager attention", lambda a, b, c: eager(a, b, c, True), q, k, v,
             args.check_seq)
    lf, lb = fwd_bwd_times(lambda a, b, c: lt.attention(a, b, c), q, k, v, args.iters, args.warmup)
    ef, eb = fwd_bwd_times(lambda a, b, c: eager(a, b, c, True), q, k, v, args.iters, args.warmup)
    res["one_process"] = {"loom_torch_forward_s": lf, "loom_torch_backward_s": lb,
                          "torch_eager_forward_s": ef, "torch_eager_backward_s": eb}

    # 3. vs the loom command. 1 process: a 1-rank gloo group in this process.
    store = dist.HashStore()
    pg = dist.ProcessGroupGloo(store, 0, 1)
    check_op("cp_attention over a 1-rank group", lambda a, b, c: lt.cp_attention(a, b, c, group=pg),
             q, k, v, args.check_seq)
    cf, cb = fwd_bwd_times(lambda a, b, c: lt.cp_attention(a, b, c, group=pg), q, k, v,
                           args.iters, args.warmup)
    af, ab = loom_attn([], args, s)
    res["p1"] = {"cp_attention_forward_s": cf, "cp_attention_backward_s": cb,
                 "attention_forward_s": lf, "attention_backward_s": lb,
                 "loom_attn_forward_s": af, "loom_attn_backward_s": ab}
    # 2 processes: loom.torchrun vs mpirun
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "w.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        # Its output captured, not discarded: a failed worker (a failed check included) was only
        # a CalledProcessError here.
        run_child([sys.executable, "-m", "loom.torchrun", "--standalone", "--nproc_per_node",
                   "2", os.path.abspath(__file__), "--worker", "--worker-out", out, "--seq",
                   str(s), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
                   "--dim", str(args.dim), "--iters", str(args.iters), "--warmup",
                   str(args.warmup), "--check-seq", str(args.check_seq)],
                  "the 2-process cp_attention run (loom.torchrun)", env=env)
        with open(out) as f:
            w = json.load(f)
    mf, mb = loom_attn(["mpirun", "-np", "2", "--oversubscribe", "--allow-run-as-root"], args, 2 * s)
    # the 2-process problem (2 * S tokens) on one process, for the scaling
    q2, k2, v2 = inputs(2 * s, args.heads, args.kv_heads, args.dim)
    sf, sb = fwd_bwd_times(lambda a, b, c: lt.attention(a, b, c), q2, k2, v2, max(2, args.iters // 2), 1)
    res["p2"] = {"cp_attention_forward_s": w["forward_s"], "cp_attention_backward_s": w["backward_s"],
                 "loom_attn_mpi_forward_s": mf, "loom_attn_mpi_backward_s": mb,
                 "one_process_forward_s": sf, "one_process_backward_s": sb}

    t = res["tiny"]
    print(f"loom.torch binding benchmark (kernel path {res['kernel_path']}, 1 thread per rank)")
    print(f"tiny shapes (S=8, H=1, D=16), median of {n} calls:")
    print(f"  _loom.attention_forward (bare C++)   {t['bare_forward_us']:8.1f} us")
    print(f"  loom.torch.attention (autograd op)   {t['op_forward_us']:8.1f} us   "
          f"(binding overhead {t['op_forward_us'] - t['bare_forward_us']:.1f} us)")
    print(f"  torch x + 1 (one torch dispatch)     {t['torch_add_us']:8.1f} us")
    print(f"  attention forward+backward: loom.torch {t['op_forward_backward_us']:.1f} us, "
          f"torch eager {t['eager_forward_backward_us']:.1f} us")
    o = res["one_process"]
    print(f"one process, S={s} H={args.heads} HKV={args.kv_heads} D={args.dim} causal fp32:")
    print(f"  forward   loom.torch {o['loom_torch_forward_s'] * 1e3:9.1f} ms   torch eager "
          f"{o['torch_eager_forward_s'] * 1e3:9.1f} ms   ratio eager/loom "
          f"{o['torch_eager_forward_s'] / o['loom_torch_forward_s']:.2f}")
    print(f"  backward  loom.torch {o['loom_torch_backward_s'] * 1e3:9.1f} ms   torch eager "
          f"{o['torch_eager_backward_s'] * 1e3:9.1f} ms   ratio eager/loom "
          f"{o['torch_eager_backward_s'] / o['loom_torch_backward_s']:.2f}")
    p1 = res["p1"]
    print(f"vs `loom attn`, S={s} per rank, ring/zigzag:")
    for label, tf_, tb_ in (("1 process  cp_attention (gloo, 1 rank)", p1["cp_attention_forward_s"], p1["cp_attention_backward_s"]),
                            ("1 process  attention", p1["attention_forward_s"], p1["attention_backward_s"])):
        print(f"  {label:40s} fwd {tf_ * 1e3:8.1f} ms ({tf_ / p1['loom_attn_forward_s']:.3f}x loom attn "
              f"{p1['loom_attn_forward_s'] * 1e3:.1f})  bwd {tb_ * 1e3:8.1f} ms "
              f"({tb_ / p1['loom_attn_backward_s']:.3f}x {p1['loom_attn_backward_s'] * 1e3:.1f})")
    p2 = res["p2"]
    print(f"  {'2 processes cp_attention (torchrun, gloo)':40s} fwd {p2['cp_attention_forward_s'] * 1e3:8.1f} ms "
          f"({p2['cp_attention_forward_s'] / p2['loom_attn_mpi_forward_s']:.3f}x mpirun loom attn "
          f"{p2['loom_attn_mpi_forward_s'] * 1e3:.1f})  bwd {p2['cp_attention_backward_s'] * 1e3:8.1f} ms "
          f"({p2['cp_attention_backward_s'] / p2['loom_attn_mpi_backward_s']:.3f}x "
          f"{p2['loom_attn_mpi_backward_s'] * 1e3:.1f})")
    print(f"2-process scaling, S={2 * s} global: 1 process fwd {p2['one_process_forward_s'] * 1e3:.1f} ms, "
          f"2 processes {p2['cp_attention_forward_s'] * 1e3:.1f} ms (speed-up "
          f"{p2['one_process_forward_s'] / p2['cp_attention_forward_s']:.2f}); bwd "
          f"{p2['one_process_backward_s'] * 1e3:.1f} / {p2['cp_attention_backward_s'] * 1e3:.1f} ms "
          f"(speed-up {p2['one_process_backward_s'] / p2['cp_attention_backward_s']:.2f})")
    if args.json:
        validate_common.write_json(args.json, res, indent=1)


if __name__ == "__main__":
    main()
