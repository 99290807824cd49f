"""loom.torch.cp_attention under torchrun (gloo): every strategy x layout x mask x GQA x dtype,
forward and backward, each compared with loom's fp64 reference AND the independent fp64 torch
implementation of common.py, plus shard/unshard and the group-level error cases.

    /usr/bin/python3 -m torch.distributed.run --standalone --nproc_per_node P tests/torch/test_cp.py

Every rank runs every case (the ops are collective); every rank checks the global results
(gathered with loom.torch.unshard). Exit status 0 iff every check passed on every rank.
"""
import contextlib
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loom  # noqa: E402
import loom.torch as lt  # noqa: E402
from common import (TOL, Checks, check_second_derivatives, doc_ids_for, normal, rel_error,  # noqa: E402
                    torch_attention_fp64)

dist.init_process_group("gloo")
P = dist.get_world_size()
RANK = dist.get_rank()
check = Checks(f"[rank {RANK}] ")
t_start = time.time()


# Problems: (name, batch, seq or docs, causal, window, dtype). bf16 problems are sized for the
# fixed bf16 bounds (>= ~100 keys per row on average, common.py).
def problems():
    out = []
    # LOOM_TEST_DTYPES=fp32 keeps the fp32 cases only (tests/torch.cmake does so at 3 processes,
    # to keep the ctest time down; 2 and 4 processes run both dtypes).
    dtypes = (torch.float32,) if os.environ.get("LOOM_TEST_DTYPES") == "fp32" else (
        torch.float32, torch.bfloat16)
    for dtype in dtypes:
        big = dtype == torch.bfloat16
        s = 301 if big else 37
        docs = [200, 1, 157, 45] if big else [13, 1, 29, 8]
        b = 1 if big else 2
        out.append(("causal", b, s, None, True, None, dtype))
        out.append(("full", b, s, None, False, None, dtype))
        out.append(("window", 1, s, None, True, 160 if big else 9, dtype))
        out.append(("cu_seqlens", 0, None, docs, True, None, dtype))
    return out


def gqa_modes():
    # H = 2P query heads; kv heads P (ulysses scatters them: Hkv % P == 0) or 1 (replicated:
    # P % Hkv == 0).
    return (("scatter", 2 * P, P), ("replicate", 2 * P, 1))


def hybrid_u():
    return 2 if P % 2 == 0 else P


DIM = 16
NAMES = ("out", "dq", "dk", "dv", "lse")


def sq_parts(x, ref):
    """[||x - ref||^2, ||ref||^2] of this rank's part (inf when x is not finite)."""
    x, ref = x.detach().double(), ref.detach().double()
    if x.shape != ref.shape or not torch.isfinite(x).all():
        return [float("inf"), 1.0]
    return [(x - ref).pow(2).sum().item(), ref.pow(2).sum().item()]


def rel_from(err2, norm2):
    err2, norm2 = float(err2), float(norm2)
    return (err2 / norm2) ** 0.5 if norm2 > 0 else err2 ** 0.5
strategies = sorted(set(lt.strategies()) | {"ring", "ulysses", "hybrid", "allgather"})
print(f"[rank {RANK}] world {P}, strategies {strategies}, kernel path {loom.torch._loom.kernel_path()}",
      flush=True) if RANK == 0 else None

worst = {}
for pi, (mask_name, batch, seq, docs, causal, window, dtype) in enumerate(problems()):
    for gi, (gqa, heads, kv_heads) in enumerate(gqa_modes()):
        gen = torch.Generator().manual_seed(1000 + 10 * pi + gi)
        if batch:
            shape_q, shape_k, cu = (batch, seq, heads, DIM), (batch, seq, kv_heads, DIM), None
            n = batch * seq
        else:
            n = sum(docs)
            shape_q, shape_k = (n, heads, DIM), (n, kv_heads, DIM)
            cu = torch.tensor([0] + list(torch.tensor(docs).cumsum(0).tolist()), dtype=torch.int32)
        q, k, v, dout = (normal(s, gen, dtype) for s in (shape_q, shape_k, shape_k, shape_q))
        # References on the exact stored values.
        qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
        ref_out, ref_lse = lt.reference_attention(qr, kr, vr, causal=causal, window=window,
                                                  cu_seqlens=cu, return_lse=True)
        ref_out.backward(dout.double())
        ref = {"out": ref_out.detach(), "dq": qr.grad, "dk": kr.grad, "dv": vr.grad,
               "lse": ref_lse}
        qt, kt, vt = (x.double().reshape(n, x.shape[-2], DIM).requires_grad_() for x in (q, k, v))
        ids = doc_ids_for(batch, seq, docs)
        t_out, t_lse = torch_attention_fp64(qt, kt, vt, causal, window, ids, DIM ** -0.5)
        t_out.backward(dout.double().reshape(n, heads, DIM))
        tref = {"out": t_out.detach().reshape(shape_q), "dq": qt.grad.reshape(shape_q),
                "dk": kt.grad.reshape(shape_k), "dv": vt.grad.reshape(shape_k)}
        tref["lse"] = (t_lse.detach().reshape(heads, batch, seq).permute(1, 0, 2) if batch
                       else t_lse.detach())
        for name in ("out", "dq", "dk", "dv", "lse"):
            e = rel_error(ref[name], tref[name])
            check(e < 1e-12, f"loom reference vs torch fp64 {mask_name}/{gqa} {name}: {e:.3g}")

        for strategy in strategies:
            for layout in lt.layouts:
                label = f"{strategy}/{layout}/{mask_name}/{gqa}/{str(dtype)[6:]}"
                kw = dict(group=None, strategy=strategy, layout=layout, causal=causal,
                          window=window, cu_seqlens=cu)
                if strategy == "hybrid":
                    kw["ulysses"] = hybrid_u()
                if strategy == "ring2d":
                    kw["inner"] = hybrid_u()
                try:
                    qs, ks, vs, ds = (lt.shard(x, layout=layout, cu_seqlens=cu) for x in (q, k, v, dout))
                    qs.requires_grad_()
                    ks.requires_grad_()
                    vs.requires_grad_()
                    out, lse = lt.cp_attention(qs, ks, vs, return_lse=True, **kw)
                    out.backward(ds)
                    got = {"out": out.detach(), "dq": qs.grad, "dk": ks.grad, "dv": vs.grad,
                           "lse": lse}
                    for name in ("out", "dq", "dk", "dv"):
                        check(got[name].dtype == dtype, f"{label} {name} dtype {got[name].dtype}")
                    # This rank's part of each global error norm, summed over the group with one
                    # all_reduce: || x - ref ||^2 and || ref ||^2 for both references.
                    sums = []
                    for name in NAMES:
                        lse_dim = 2 if batch else 1
                        for r in (ref, tref):
                            mine = lt.shard(r[name], layout=layout, cu_seqlens=cu,
                                            dim=lse_dim if name == "lse" else None)
                            sums += sq_parts(got[name], mine)
                    sums = torch.tensor(sums, dtype=torch.float64)
                    dist.all_reduce(sums)
                    for i, name in enumerate(NAMES):
                        tol = TOL[dtype][name]
                        e1 = rel_from(sums[4 * i], sums[4 * i + 1])
                        e2 = rel_from(sums[4 * i + 2], sums[4 * i + 3])
                        key = (str(dtype)[6:], name)
                        worst[key] = max(worst.get(key, 0), e1)
                        check(e1 <= tol and e2 <= tol,
                              f"{label} {name}: rel error {e1:.3g} (loom ref), {e2:.3g} (torch ref) > {tol:.3g}")
                except loom.Error as err:
                    check(False, f"{label}: raised {type(err).__name__}: {err}")

# shard/unshard round trip on an odd length, labels [B, S] included.
gen = torch.Generator().manual_seed(7)
x = torch.randn(3, 23, 5, generator=gen)
labels = torch.randint(0, 100, (3, 23), generator=gen)
for layout in lt.layouts:
    check(torch.equal(lt.unshard(lt.shard(x, layout=layout), layout=layout), x), f"unshard(shard) {layout}")
    check(torch.equal(lt.unshard(lt.shard(labels, layout=layout), layout=layout), labels),
          f"unshard(shard) labels {layout}")
    cu = [0, 5, 6, 23]
    xt = x[0]
    check(torch.equal(lt.unshard(lt.shard(xt, layout=layout, cu_seqlens=cu), layout=layout,
                                 cu_seqlens=cu), xt), f"unshard(shard) thd {layout}")
# zigzag on S divisible by 2P is ring-flash-attention's split: chunks r and 2P-1-r.
s = 4 * P
x = torch.arange(s).view(1, s, 1, 1).float()
mine = lt.shard(x).flatten().long().tolist()
c = s // (2 * P)
expect = list(range(RANK * c, (RANK + 1) * c)) + list(range((2 * P - 1 - RANK) * c, (2 * P - RANK) * c))
check(mine == expect, f"zigzag shard of {s} tokens is chunks {RANK} and {2 * P - 1 - RANK}: {mine}")


# Errors that need a group: each must raise the named loom error on every rank, never hang.
def expect_error(kind, text, fn):
    try:
        fn()
    except kind as e:
        check(text in str(e), f"error text: wanted {text!r} in {e}")
        if RANK == 0 or kind is loom.Timeout:
            print(f"[rank {RANK}] raised as expected: {type(e).__module__}.{type(e).__name__}: {e}",
                  flush=True)
        return str(e)
    except Exception as e:  # noqa: BLE001
        check(False, f"wanted {kind.__name__} ({text!r}), got {type(e).__name__}: {e}")
        return ""
    check(False, f"wanted {kind.__name__} ({text!r}), nothing raised")
    return ""


q = torch.randn(1, 8, 2 * P, DIM)
k = torch.randn(1, 8, P, DIM)
expect_error(loom.InvalidArgument, "unknown strategy", lambda: lt.cp_attention(q, k, k, strategy="spiral"))
expect_error(loom.InvalidArgument, "needs ulysses", lambda: lt.cp_attention(q, k, k, strategy="hybrid"))
expect_error(loom.InvalidArgument, "ulysses= is only", lambda: lt.cp_attention(q, k, k, ulysses=1))
expect_error(loom.InvalidArgument, "needs inner", lambda: lt.cp_attention(q, k, k, strategy="ring2d"))
expect_error(loom.InvalidArgument, "inner= is only", lambda: lt.cp_attention(q, k, k, inner=1))
expect_error(loom.InvalidArgument, "ulysses=1099511627776 is larger than any process group",
             lambda: lt.cp_attention(q, k, k, strategy="hybrid", ulysses=2**40))
# The strategies' rules name the Python arguments (they said "--ulysses 3", "--inner 3").
msg = expect_error(loom.InvalidArgument, f"hybrid: ulysses={P + 1} must divide",
                   lambda: lt.cp_attention(q, k, k, strategy="hybrid", ulysses=P + 1))
check("--" not in msg, f"no command-line option in {msg!r}")
expect_error(loom.InvalidArgument, f"ring2d: inner={P + 1} must divide",
             lambda: lt.cp_attention(q, k, k, strategy="ring2d", inner=P + 1))
expect_error(loom.InvalidArgument, "timeout must be from 0.001 to 1e9 seconds, got inf",
             lambda: lt.set_timeout(float("inf")))
# Not a process group: raised before any exchange. Where the process belongs to one group of more
# than one rank, the rank's next call over it makes this call's exchange first (marked refused);
# here every rank passed it, so every rank's next call makes that exchange and then its own.
expect_error(loom.InvalidArgument, "must be a torch.distributed ProcessGroup, got str" + (
             "; the other ranks of this process's group may be waiting in their cp_attention: "
             "this rank's next cp_attention or unshard over it makes this call's exchange first"
             if P > 1 else ""), lambda: lt.cp_attention(q, k, k, group="world"))
if P > 1:
    # Ranks that disagree on an argument: a clear error on every rank, not a hang.
    expect_error(loom.InvalidArgument, "disagree on causal",
                 lambda: lt.cp_attention(q, k, k, causal=(RANK == 0)))
    # The values named as the caller wrote them (the strategy and the dtype were internal codes,
    # cu_seqlens a hash).
    msg = expect_error(loom.InvalidArgument, "disagree on strategy: rank ",
                       lambda: lt.cp_attention(q, k, k, strategy="ring" if RANK == 0 else "allgather"))
    check("passed 'ring'" in msg and "passed 'allgather'" in msg, f"strategies by name: {msg}")
    msg = expect_error(loom.InvalidArgument, "disagree on dtype",
                       lambda: lt.cp_attention(*((x.bfloat16() if RANK == 0 else x) for x in (q, k, k))))
    check("passed bfloat16" in msg and "passed float32" in msg, f"dtypes by name: {msg}")
    msg = expect_error(loom.InvalidArgument, "disagree on cu_seqlens: rank ",
                       lambda: lt.cp_attention(q[0], k[0], k[0],
                                               cu_seqlens=[0, 8 * P] if RANK == 0 else [0, 4, 8 * P]))
    check("passed one, rank" in msg and "passed another" in msg, f"cu_seqlens, not its hash: {msg}")
    # Inputs that require grad on one rank only: its backward, which is collective, waited for
    # the others until the timeout; refused at the forward on every rank.
    qg = q.clone().requires_grad_(RANK == 0)
    msg = expect_error(loom.InvalidArgument, "disagree on requires_grad",
                       lambda: lt.cp_attention(qg, k, k))
    check("passed True" in msg and "passed False" in msg, f"requires_grad by value: {msg}")
    with torch.no_grad() if RANK == 1 else contextlib.nullcontext():
        expect_error(loom.InvalidArgument, "disagree on requires_grad",
                     lambda: lt.cp_attention(q.clone().requires_grad_(), k, k))
    # An argument that one rank alone cannot take (checked in Python, or the strategy's name in
    # loom) raises on every rank at once, naming that rank: the others waited until the timeout.
    t0 = time.time()
    expect_error(loom.InvalidArgument, "dtype torch.float16" if RANK == P - 1 else
                 f"rank {P - 1} could not take its arguments (its own error says why)",
                 lambda: lt.cp_attention(*((x.half() if RANK == P - 1 else x) for x in (q, k, k))))
    expect_error(loom.InvalidArgument, "unknown strategy" if RANK == 0 else
                 "rank 0 could not take its arguments",
                 lambda: lt.cp_attention(q, k, k, strategy="spiral" if RANK == 0 else "ring"))
    expect_error(loom.InvalidArgument, "is not contiguous" if RANK == 0 else
                 "rank 0 could not take its arguments",
                 lambda: lt.cp_attention(q.transpose(1, 2) if RANK == 0 else q, k, k))
    expect_error(loom.InvalidArgument, "dim 7 is outside" if RANK == 0 else
                 "unshard: rank 0 could not take its arguments",
                 lambda: lt.unshard(q, dim=7 if RANK == 0 else None))
    check(time.time() - t0 < 20, f"one rank's bad arguments: every rank raised at once ({time.time() - t0:.1f} s)")
    # A shard length that the layout cannot give this rank.
    qbad = torch.randn(1, 8 + (3 * P if RANK == P - 1 else 0), 2 * P, DIM)
    kbad = torch.randn(1, qbad.shape[1], P, DIM)
    expect_error(loom.InvalidArgument, "shard the input with loom.torch.shard",
                 lambda: lt.cp_attention(qbad, kbad, kbad))
    # Heads the ulysses degree cannot split.
    q3 = torch.randn(1, 8, P + 1, DIM)
    k3 = torch.randn(1, 8, 1, DIM)
    expect_error(loom.InvalidArgument, "divisible", lambda: lt.cp_attention(q3, k3, k3, strategy="ulysses"))
    # cu_seqlens that do not describe the ranks' tokens.
    expect_error(loom.InvalidArgument, "cu_seqlens describes",
                 lambda: lt.cp_attention(q[0], k[0], k[0], cu_seqlens=[0, 3, 5]))

    # A NaN in k on one rank's shard reaches, through every strategy's exchange and merge, every
    # row that sees that key, as the formula says (loom's fp64 reference); the other kv head stays
    # finite.
    gen = torch.Generator().manual_seed(77)
    qf, kf, vf, df = (torch.randn(1, 64, hk, DIM, generator=gen) for hk in (2 * P, P, P, 2 * P))
    kf[0, 41, P - 1, 3] = float("nan")
    qr, kr, vr = (x.double().requires_grad_() for x in (qf, kf, vf))
    rout = lt.reference_attention(qr, kr, vr)
    rout.backward(df.double())
    ref = {"out": rout.detach(), "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}
    for strategy in strategies:
        kw = {"ulysses": hybrid_u()} if strategy == "hybrid" else {"inner": hybrid_u()} if strategy == "ring2d" else {}
        qs, ks, vs, ds = (lt.shard(x) for x in (qf, kf, vf, df))
        qs.requires_grad_()
        ks.requires_grad_()
        vs.requires_grad_()
        o = lt.cp_attention(qs, ks, vs, strategy=strategy, **kw)
        o.backward(ds)
        got = {n: lt.unshard(x.detach()) for n, x in (("out", o), ("dq", qs.grad), ("dk", ks.grad), ("dv", vs.grad))}
        for n in ("out", "dq", "dk", "dv"):
            miss = ~torch.isfinite(ref[n]) & torch.isfinite(got[n])
            check(not miss.any(), f"{strategy}: NaN in k: {n} finite where the formula is not, first at "
                                  f"{miss.nonzero()[:1].tolist()}")
            clean = list(range(2 * P - 2)) if n in ("out", "dq") else list(range(P - 1))
            check(torch.isfinite(got[n][:, :, clean]).all(), f"{strategy}: NaN in k: {n} of the clean kv heads finite")
        check(not torch.isfinite(ref["out"]).all(), "the formula's out is NaN somewhere")

    # A row whose every visible score is -inf (an -inf in q against keys of one sign in that
    # dim): the formula's softmax is 0 / 0, NaN (PyTorch's too); it came out as a row that sees
    # no key (out 0, lse -inf) on every strategy.
    qi, ki, vi = qf.clone(), kf.clone(), vf.clone()
    ki[0, :, 0, 2] = kf[0, :, 0, 2].abs() + 0.1
    ki[0, 41, P - 1, 3] = 0.5
    qi[0, 50, 1, 2] = float("-inf")
    for strategy in strategies:
        kw = {"ulysses": hybrid_u()} if strategy == "hybrid" else {"inner": hybrid_u()} if strategy == "ring2d" else {}
        o, l = lt.cp_attention(*(lt.shard(x) for x in (qi, ki, vi)), strategy=strategy, return_lse=True, **kw)
        o = lt.unshard(o)
        nan = torch.isnan(o)
        check(nan[0, 50, 1].all() and nan.sum() == DIM, f"{strategy}: -inf row: out NaN in that row only")
        l = lt.unshard(l, dim=2)
        check(torch.isnan(l[0, 1, 50]) and torch.isnan(l).sum() == 1,
              f"{strategy}: -inf row: lse NaN in that row only")

    # Under torch.autograd.detect_anomaly a NaN or Inf on one rank is refused instead: every rank
    # raises the error naming that rank and tensor, none waits for the others. The ranks must
    # agree on the mode (the backward's check is one more exchange).
    kn = k.clone()
    if RANK == P - 1:
        kn[0, 2, 1, 3] = float("nan")
    with torch.autograd.detect_anomaly():
        expect_error(loom.InvalidArgument,
                     f"rank {P - 1}'s k holds a NaN or Inf (row 2, head 1, dim 3 of this rank's [8, {P}, {DIM}])",
                     lambda: lt.cp_attention(q, kn, k))
        qg = q.clone().requires_grad_()
        o = lt.cp_attention(qg, k, k)
        dn = torch.ones_like(o)
        if RANK == 0:
            dn[0, 5, 0, 0] = float("inf")
        expect_error(loom.InvalidArgument, "cp_attention backward: rank 0's dout holds a NaN or Inf (row 5, head 0",
                     lambda: o.backward(dn))
    with torch.autograd.set_detect_anomaly(RANK == 0):
        expect_error(loom.InvalidArgument, "disagree on detect_anomaly", lambda: lt.cp_attention(q, k, k))

    # Ranks out of step: rank 0 in a backward (under detect_anomaly, which also checks dout) while
    # the others start the next forward, or rank 0 in unshard while the others are in
    # cp_attention. One clear error on every rank: the exchanges once had different sizes on one
    # tag, and gloo aborted the process (or a rank read the other call's message as its own).
    with torch.autograd.detect_anomaly():
        qg = q.clone().requires_grad_()
        o = lt.cp_attention(qg, k, k)
        expect_error(loom.InvalidArgument,
                     "is in the backward of cp_attention while rank" if RANK == 0
                     else "while rank 0 is in the backward of cp_attention",
                     (lambda: o.sum().backward()) if RANK == 0 else (lambda: lt.cp_attention(q, k, k)))
    expect_error(loom.InvalidArgument, "every rank of the group must make the same loom.torch calls",
                 (lambda: lt.unshard(q)) if RANK == 0 else (lambda: lt.cp_attention(q, k, k)))

    # cu_seqlens past int64 on one rank: its call raised a pybind TypeError before the ranks'
    # exchange, and its next call paired with the others' pending one (wrong answers on both, no
    # error). Refused in Python now, every rank raising at once.
    expect_error(loom.InvalidArgument, "past 2^63 - 1 tokens" if RANK == 1 else
                 "rank 1 could not take its arguments",
                 lambda: lt.cp_attention(q[0], k[0], k[0],
                                         cu_seqlens=[0, 4, 2**64] if RANK == 1 else [0, 4, 8 * P]))
    # A `group` that is not a process group on one rank (rank 1's "world" for a call that the
    # others make over the default group), caught, and that rank carries on: its next call paired
    # with the others' pending one, and every call after it with the others' previous one (other
    # calls' results, no error). Now its next call makes the lost call's exchange first, marked
    # refused: the others' pending call raises, and every call after matches the fp64 reference.
    # The same in unshard.
    gen = torch.Generator().manual_seed(13)
    full = [torch.randn(1, 4 * P, h, DIM, generator=gen) for h in (2 * P, P, P)]
    lost = [lt.shard(torch.randn(x.shape, generator=gen)) for x in full]
    if RANK == 1:
        expect_error(loom.InvalidArgument, "got str; the other ranks of this process's group may be "
                     "waiting in their cp_attention", lambda: lt.cp_attention(*lost, group="world"))
    else:
        expect_error(loom.InvalidArgument, "cp_attention: rank 1 could not take its arguments",
                     lambda: lt.cp_attention(*lost))
    for call in range(2):
        got = lt.unshard(lt.cp_attention(*(lt.shard(x) for x in full)))
        err = rel_error(got, lt.reference_attention(*full))
        check(err <= 1e-5, f"call {call} after one rank's group='world': out rel error {err:.3g}")
    xs = lt.shard(torch.arange(12.0 * P).view(1, 4 * P, 3))
    if RANK == 0:
        expect_error(loom.InvalidArgument, "got list; the other ranks of this process's group may be "
                     "waiting in their unshard", lambda: lt.unshard(xs * 2, group=[0, 1]))
    else:
        expect_error(loom.InvalidArgument, "unshard: rank 0 could not take its arguments",
                     lambda: lt.unshard(xs * 2))
    check(torch.equal(lt.unshard(xs), torch.arange(12.0 * P).view(1, 4 * P, 3)),
          "unshard after one rank's group=[0, 1]")
    # A call that raised on one rank before the ranks met (begin_forward alone stands for it):
    # every rank's next call is refused as out of step instead of pairing with another call;
    # the counts are then equal again and the call after works.
    if RANK == 0:
        lt._group(None).begin_forward()
    expect_error(loom.InvalidArgument, "cp_attention: ranks out of step: this is rank "
                 f"{RANK}'s cp_attention call", lambda: lt.cp_attention(q, k, k))
    out_again = lt.cp_attention(q, k, k)
    check(out_again.shape == q.shape and torch.isfinite(out_again).all(), "in step after the refusal")
    # The scale and the window as the caller wrote them ("passed 0.000000", None as 0).
    msg = expect_error(loom.InvalidArgument, "disagree on scale",
                       lambda: lt.cp_attention(q, k, k, scale=1e-7 if RANK == 0 else 2e-7))
    check("passed 1e-07" in msg and "passed 2e-07" in msg, f"scales as written: {msg}")
    msg = expect_error(loom.InvalidArgument, "disagree on window",
                       lambda: lt.cp_attention(q, k, k, window=None if RANK == 0 else 5))
    check("passed None" in msg and "passed 5" in msg, f"window None by name: {msg}")

    # The same outside anomaly mode, where every backward opens with the same check (it once went
    # straight to the engine's messages: a skipped or extra backward ended in loom.Timeout after
    # the timeout, the allgather strategy's in gloo aborting the process, and the backwards of two
    # calls of one shape in gradients mixed from both, without an error). A short timeout, so
    # that a wait here fails the test in seconds; a Timeout leaves the group unusable: stop.
    group = lt._group(None)
    timeout_before = group.timeout_s
    lt.set_timeout(5.0)
    out_of_step = "every rank of the group must make the same loom.torch calls in the same order"

    def step_error(odd, odd_call, others_call, odd_text, others_text):
        """Rank `odd` runs odd_call, the others others_call: each must raise InvalidArgument
        naming its own call and the first other rank's (the odd rank names rank 0, or rank 1 if
        it is rank 0 itself); odd_text / others_text: (what the rank says of its own call, what
        another rank says of it)."""
        first_other = 1 if odd == 0 else 0
        if RANK == odd:
            text = f"rank {RANK} is in {odd_text[0]} while rank {first_other} is in {others_text[1]}"
        else:
            text = f"rank {RANK} is in {others_text[0]} while rank {odd} is in {odd_text[1]}"
        before = len(check.failures)
        expect_error(loom.InvalidArgument, f"loom.torch: {text}: {out_of_step}",
                     odd_call if RANK == odd else others_call)
        if any("Timeout" in f or "CommError" in f for f in check.failures[before:]):
            print(f"[rank {RANK}] FAIL: a wait ended in the out-of-step case above; the group is "
                  "unusable, stopping", flush=True)
            sys.stdout.flush()
            os._exit(1)

    fwd = ("cp_attention (the forward)",) * 2
    bwd = ("the backward of cp_attention",) * 2
    for strategy in ("ring", "allgather"):
        # Rank 0 skips the backward: the others' backward meets its next forward.
        qg = q.clone().requires_grad_()
        o = lt.cp_attention(qg, k, k, strategy=strategy)
        step_error(0, lambda: lt.cp_attention(q, k, k, strategy=strategy), lambda: o.sum().backward(),
                   fwd, bwd)
        # Rank P - 1 runs an extra backward (retain_graph) while the others call the next forward.
        qg = q.clone().requires_grad_()
        o = lt.cp_attention(qg, k, k, strategy=strategy)
        o.sum().backward(retain_graph=True)
        step_error(P - 1, lambda: o.sum().backward(), lambda: lt.cp_attention(q, k, k, strategy=strategy),
                   bwd, fwd)
    # Two calls of one shape, a and b; rank 0 skips b's backward and runs a's while the others run
    # b's: both are backwards, of different calls (the engine's messages matched: wrong gradients).
    qa, qb = q.clone().requires_grad_(), (2 * q).requires_grad_()
    a = lt.cp_attention(qa, k, k)
    call_a = group.forward_calls
    b = lt.cp_attention(qb, k, k)
    call_b = group.forward_calls
    check(call_b == call_a + 1, f"forward_calls counts the forwards: {call_a}, then {call_b}")
    bwd_a, bwd_b = ((f"the backward of cp_attention call {c} of this group", f"the backward of call {c}")
                    for c in (call_a, call_b))
    step_error(0, lambda: a.sum().backward(), lambda: b.sum().backward(), bwd_a, bwd_b)
    # The group is in step again: a backward right after the errors works.
    qg = q.clone().requires_grad_()
    lt.cp_attention(qg, k, k).sum().backward()
    check(qg.grad is not None and torch.isfinite(qg.grad).all(), "a backward after the out-of-step errors")
    lt.set_timeout(timeout_before)
    # unshard: parts that disagree are refused on every rank (a bf16 part was read as the bytes of
    # fp32 ones, a wrong tensor, or gloo aborted the process; another layout gave a wrong tensor).
    xs = lt.shard(torch.arange(16.0 * P).view(1, 8 * P, 2))
    expect_error(loom.InvalidArgument, "disagree on the dtype",
                 lambda: lt.unshard(xs.bfloat16() if RANK == 0 else xs))
    expect_error(loom.InvalidArgument, "they must agree but along dim 1",
                 lambda: lt.unshard(torch.cat([xs, xs], 2) if RANK == 0 else xs))
    expect_error(loom.InvalidArgument, "disagree on the layout",
                 lambda: lt.unshard(xs, layout="stripe" if RANK == 0 else "zigzag"))
    check(torch.equal(lt.unshard(xs), torch.arange(16.0 * P).view(1, 8 * P, 2)), "unshard after its errors")
    # Rows of no elements (a 0 in another dim) gather to the global shape (a raw torch error).
    z = lt.unshard(lt.shard(torch.zeros(2, 4 * P + 1, 0)))
    check(z.shape == (2, 4 * P + 1, 0), f"unshard of empty rows: shape {list(z.shape)}")

    # Every route to a second derivative through cp_attention raises NotSupported on every rank
    # (jvp, hvp and hessian returned zeros, a gradient penalty the first-order part alone), from
    # each rank's own second backward, which makes no exchange: the ranks stay in step.
    gen = torch.Generator().manual_seed(17)
    shards = [lt.shard(torch.randn(1, 2 * P, h, 2, generator=gen)) for h in (2, 1, 1)]
    check_second_derivatives(check, lambda a, b, c: lt.cp_attention(a, b, c),
                             "the backward of cp_attention", *shards)
    out = lt.cp_attention(*shards)
    check(torch.isfinite(out).all(), "a call after the second-derivative routes")

# Groups that torch.distributed destroys are forgotten: each kept its sockets and its ops' buffers
# (30 new_group / destroy_process_group rounds kept 60 more file descriptors open at P = 2).
fds_before = len(os.listdir("/proc/self/fd"))
for _ in range(10):
    pg = dist.new_group(list(range(P)))
    lt.cp_attention(q, k, k, group=pg)
    dist.destroy_process_group(pg)
fds_after = len(os.listdir("/proc/self/fd"))
check(fds_after <= fds_before + 4 * (P - 1) + 2 and len(lt._groups) <= 2,
      f"destroyed groups are released: file descriptors {fds_before} -> {fds_after}, "
      f"{len(lt._groups)} groups held")

# A sequence shorter than 2P, or short documents, give some ranks no tokens: a valid call (it
# raised "q holds no tokens" on those ranks alone, and the others waited until the timeout).
for strategy in ("ring", "ulysses", "allgather"):
    for seq, cu in ((P - 1, None), (None, [0, 1, 2, 2 + P])):
        gen = torch.Generator().manual_seed(31 + P)
        t = seq if cu is None else cu[-1]
        full = [torch.randn(*((1, t) if cu is None else (t,)), h, DIM, generator=gen)
                for h in (2 * P, P, P, 2 * P)]
        shards = [lt.shard(x, cu_seqlens=cu) for x in full]
        for x in shards[:3]:
            x.requires_grad_()
        o = lt.cp_attention(*shards[:3], strategy=strategy, cu_seqlens=cu)
        o.backward(shards[3])
        refs = [x.double().requires_grad_() for x in full[:3]]
        ro = lt.reference_attention(*refs, cu_seqlens=cu)
        ro.backward(full[3].double())
        for name, got, ref in (("out", o.detach(), ro), ("dq", shards[0].grad, refs[0].grad),
                               ("dk", shards[1].grad, refs[1].grad), ("dv", shards[2].grad, refs[2].grad)):
            err = rel_error(lt.unshard(got, cu_seqlens=cu), ref)
            check(err <= TOL[torch.float32][name],
                  f"{strategy}, {t} tokens over {P} ranks (this rank {shards[0].shape[0 if cu else 1]}): "
                  f"{name} rel error {err:.3g}")

# Every rank passing the whole sequence (lt.shard forgotten) is a valid call, read as P copies of
# it one after another: a UserWarning naming lt.shard, once per group, at the caller's line.
# Shards, or a constant q (zeros: test data that may repeat on every rank), give none.
if P > 1:
    gen = torch.Generator().manual_seed(5)
    qw, kw, vw = (torch.randn(1, 8 * P, h, DIM, generator=gen) for h in (2 * P, P, P))
    pg, pg0 = dist.new_group(list(range(P))), dist.new_group(list(range(P)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lt.cp_attention(*(lt.shard(x, pg) for x in (qw, kw, vw)), group=pg)
        lt.cp_attention(torch.zeros_like(qw), kw, vw, group=pg0)
        check(not caught, f"shards or a constant q: no warning, got {[str(w.message) for w in caught]}")
        lt.cp_attention(qw, kw, vw, group=pg)
        lt.cp_attention(qw, kw, vw, group=pg)
    msgs = [(str(w.message), w.category, w.filename) for w in caught]
    check(len(msgs) == 1 and msgs[0][1] is UserWarning and msgs[0][2] == __file__
          and f"every rank of the group passed the same q ({8 * P} rows each" in msgs[0][0]
          and "shard q, k and v first (loom.torch.shard" in msgs[0][0],
          f"unsharded inputs: one UserWarning at the caller, got {msgs}")
    # Rank 0's shard beside the other ranks' whole sequence is refused (the rows do not fit the
    # layout) with no warning: a zigzag shard's first and last rows are the sequence's, so the
    # fingerprints matched, the false warning used up the group's one, and the next call, the
    # whole sequence on every rank, went unwarned.
    pg1 = dist.new_group(list(range(P)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mixed = [lt.shard(x, pg1) if RANK == 0 else x for x in (qw, kw, vw)]
        expect_error(loom.InvalidArgument, "rows but layout 'zigzag'",
                     lambda: lt.cp_attention(*mixed, group=pg1))
        check(not caught, f"a shard beside whole sequences: no warning, got "
                          f"{[str(w.message) for w in caught]}")
        lt.cp_attention(qw, kw, vw, group=pg1)
    check(len(caught) == 1 and "every rank of the group passed the same q" in str(caught[0].message),
          f"the whole sequence on every rank after a refused call: one warning, got "
          f"{[str(w.message) for w in caught]}")
    dist.destroy_process_group(pg1)
    # A warnings filter that makes the warning an error on rank 0 alone (filters are per process):
    # rank 0 raised while the others went on into the engine ("rank 1 is in an unknown call", or
    # a Timeout, and the group was dead). Now every rank raises, and the calls after it work. The
    # op is built first (a q of each rank's own), so that the warning's call finds it cached.
    lt.set_timeout(5.0, pg0)
    lt.cp_attention(qw + RANK, kw, vw, group=pg0)
    with warnings.catch_warnings():
        warnings.simplefilter("error" if RANK == 0 else "ignore")
        expect_error(UserWarning if RANK == 0 else loom.InvalidArgument,
                     "cp_attention: every rank of the group passed the same q" if RANK == 0 else
                     "cp_attention: rank 0 raised on the warning that every rank passed the same q "
                     "(a warnings filter made it an error there); every rank of the group raises",
                     lambda: lt.cp_attention(qw, kw, vw, group=pg0))
    for call in range(2):
        got = lt.unshard(lt.cp_attention(*(lt.shard(x, pg0) for x in (qw, kw, vw)), group=pg0), pg0)
        err = rel_error(got, lt.reference_attention(qw, kw, vw))
        check(err <= 1e-5, f"call {call} after the warning raised on rank 0: out rel error {err:.3g}")
    dist.destroy_process_group(pg)
    dist.destroy_process_group(pg0)

# One more real call after the errors: the group is still usable.
qs = lt.shard(torch.randn(1, 29, 2 * P, DIM))
out = lt.cp_attention(qs, lt.shard(torch.randn(1, 29, P, DIM)), lt.shard(torch.randn(1, 29, P, DIM)))
check(out.shape == qs.shape, "a call after the error cases works")

bad = torch.tensor([len(check.failures)], dtype=torch.int64)
dist.all_reduce(bad)
if RANK == 0:
    for (dt, name), e in sorted(worst.items()):
        print(f"worst rel error vs loom reference, {dt} {name}: {e:.3g} (tolerance {TOL[getattr(torch, {'float32': 'float32', 'bfloat16': 'bfloat16'}[dt])][name]:.3g})")
    print(f"test_cp world {P}: {check.count} checks on rank 0, {int(bad.item())} failures over all ranks, "
          f"{time.time() - t_start:.1f} s", flush=True)
# Last: a rank that never comes. Every other rank's wait must end in loom.Timeout naming the
# ranks, after loom's timeout, not hang. (gloo closes its connections after a timeout, so the
# group is unusable afterwards: nothing follows but the exit; rank 0 stays alive past the
# others' timeout so that they see a timeout, not a closed connection.)
status = 1 if bad.item() else 0
if P > 1:
    lt.set_timeout(1.0)
    # Not a process group, in a process of two groups: loom cannot tell which one's ranks wait for
    # the call, so every later collective call of the process over a group of more than one rank
    # raises at once, meeting no one (the others end in loom.Timeout, as below).
    pg2 = dist.new_group(list(range(P)))
    if RANK == 0:
        before = len(check.failures)
        expect_error(loom.InvalidArgument, "this process belongs to 2 groups, and loom cannot tell",
                     lambda: lt.cp_attention(q, k, k, group="world"))
        t0 = time.time()
        for call in (lambda: lt.cp_attention(q, k, k), lambda: lt.unshard(q, pg2)):
            expect_error(loom.InvalidArgument, "earlier cp_attention call with group='world', not a "
                         "process group, never met the other ranks", call)
        check(time.time() - t0 < 0.5, f"raised without waiting ({time.time() - t0:.2f} s)")
        if len(check.failures) > before:
            status = 1
    if RANK != 0:
        before = len(check.failures)
        t0 = time.time()
        expect_error(loom.Timeout, "timed out after", lambda: lt._group(None).barrier())
        took = time.time() - t0
        check(0.9 <= took <= 10, f"the timeout took {took:.2f} s (timeout 1 s)")
        if len(check.failures) > before:
            status = 1
        else:
            print(f"[rank {RANK}] a missing rank: loom.Timeout after {took:.2f} s", flush=True)
    else:
        time.sleep(4)
sys.stdout.flush()
os._exit(status)
