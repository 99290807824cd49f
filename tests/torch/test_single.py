"""loom.torch on one process (plain /usr/bin/python3, no launcher): attention() against torch's own
eager attention and both fp64 references, forward and backward, fp32 and bf16, bshd and thd;
reference_attention's gradients; and an error case for every bad input.

    PYTHONPATH=build/python /usr/bin/python3 tests/torch/test_single.py
"""
import os
import sys
import threading
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loom  # noqa: E402
import loom.torch as lt  # noqa: E402
from common import (TOL, Checks, check_second_derivatives, doc_ids_for, normal, rel_error,  # noqa: E402
                    torch_attention_fp64)

check = Checks()


def eager_attention(q, k, v, causal, window, scale):
    """torch's own eager attention on [B, S, H, D] in the storage dtype's compute type (fp32):
    matmul, mask, softmax, matmul."""
    b, s, h, d = q.shape
    g = h // k.shape[2]
    qh = q.float().transpose(1, 2)
    kh = k.float().repeat_interleave(g, dim=2).transpose(1, 2)
    vh = v.float().repeat_interleave(g, dim=2).transpose(1, 2)
    scores = qh @ kh.transpose(-1, -2) * scale
    i = torch.arange(s)
    allowed = torch.ones(s, s, dtype=torch.bool)
    if causal:
        allowed &= i[None, :] <= i[:, None]
    if window:
        allowed &= (i[:, None] - i[None, :]).abs() < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2).to(q.dtype)


DIM = 32
seed = 0
for dtype in (torch.float32, torch.bfloat16):
    s = 37 if dtype == torch.float32 else 300
    for causal, window in ((True, None), (False, None), (True, 17), (False, 64)):
        for heads, kv_heads in ((4, 4), (4, 2), (4, 1)):
            seed += 1
            gen = torch.Generator().manual_seed(seed)
            q, dout = (normal((2, s, heads, DIM), gen, dtype) for _ in range(2))
            k, v = (normal((2, s, kv_heads, DIM), gen, dtype) for _ in range(2))
            label = f"{str(dtype)[6:]} causal={causal} window={window} H={heads} Hkv={kv_heads}"
            qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
            out, lse = lt.attention(qa, ka, va, causal=causal, window=window, return_lse=True)
            out.backward(dout)
            qe, ke, ve = (x.clone().requires_grad_() for x in (q, k, v))
            eager = eager_attention(qe, ke, ve, causal, window, DIM ** -0.5)
            eager.backward(dout)
            qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
            ref, ref_lse = lt.reference_attention(qr, kr, vr, causal=causal, window=window,
                                                  return_lse=True)
            ref.backward(dout.double())
            n = 2 * s
            qt, kt, vt = (x.double().reshape(n, x.shape[2], DIM).requires_grad_() for x in (q, k, v))
            t_out, t_lse = torch_attention_fp64(qt, kt, vt, causal, window or 0,
                                                doc_ids_for(2, s, None), DIM ** -0.5)
            t_out.backward(dout.double().reshape(n, heads, DIM))
            pairs = {"out": (out, ref, t_out.reshape(out.shape), eager),
                     "dq": (qa.grad, qr.grad, qt.grad.reshape(q.shape), qe.grad),
                     "dk": (ka.grad, kr.grad, kt.grad.reshape(k.shape), ke.grad),
                     "dv": (va.grad, vr.grad, vt.grad.reshape(v.shape), ve.grad),
                     "lse": (lse, ref_lse, t_lse.reshape(heads, 2, s).permute(1, 0, 2), None)}
            for name, (got, r1, r2, e) in pairs.items():
                tol = TOL[dtype][name]
                check(got.dtype == (torch.float32 if name == "lse" else dtype), f"{label} {name} dtype")
                e1, e2 = rel_error(got, r1), rel_error(got, r2)
                check(e1 <= tol and e2 <= tol, f"{label} {name}: {e1:.3g} / {e2:.3g} > {tol:.3g}")
                if e is not None:
                    # torch eager is itself an approximation: both are within their dtype's
                    # tolerance of the fp64 answer, so they are within twice it of each other.
                    ee = rel_error(e, r1)
                    check(rel_error(got, e) <= 2 * tol or ee > tol,
                          f"{label} {name}: loom vs torch eager {rel_error(got, e):.3g}")
                    if ee > tol:
                        print(f"note: torch eager itself is {ee:.3g} from fp64 ({label} {name})")

# thd with cu_seqlens, odd lengths, a one-token document.
gen = torch.Generator().manual_seed(99)
docs = [7, 1, 30, 13]
cu = torch.tensor([0, 7, 8, 38, 51], dtype=torch.int64)
for window in (None, 5):
    q, dout = (torch.randn(51, 6, 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(51, 3, 8, generator=gen) for _ in range(2))
    qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
    out = lt.attention(qa, ka, va, cu_seqlens=cu, window=window)
    out.backward(dout)
    qt, kt, vt = (x.double().requires_grad_() for x in (q, k, v))
    t_out, _ = torch_attention_fp64(qt, kt, vt, True, window or 0, doc_ids_for(0, None, docs), 8 ** -0.5)
    t_out.backward(dout.double())
    for name, got, r in (("out", out, t_out), ("dq", qa.grad, qt.grad), ("dk", ka.grad, kt.grad),
                         ("dv", va.grad, vt.grad)):
        e = rel_error(got, r)
        check(e <= 1e-5, f"thd window={window} {name}: {e:.3g}")
# A scale other than 1/sqrt(D).
q = torch.randn(1, 9, 2, 8)
o1 = lt.attention(q, q, q, scale=0.3)
o2 = lt.reference_attention(q, q, q, scale=0.3)
check(rel_error(o1, o2) <= 1e-5, "scale=0.3")
check(rel_error(o1, lt.attention(q, q, q)) > 1e-3, "scale changes the result")

# reference_attention's backward against torch autograd through the fp64 torch implementation
# (gradcheck on a tiny problem: the reference's gradient is exact).
qg, kg, vg = (torch.randn(1, 5, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
check(torch.autograd.gradcheck(lambda a, b, c: lt.reference_attention(a, b, c, window=3), (qg, kg, vg)),
      "gradcheck reference_attention")


# Bad input: one clear exception each, naming the value.
def expect_error(kind, text, fn):
    try:
        fn()
    except kind as e:
        check(text in str(e), f"error text: wanted {text!r} in {e!r}")
        check("\n" not in str(e), f"one line: {e!r}")
        return
    except Exception as e:  # noqa: BLE001
        check(False, f"wanted {kind.__name__} ({text!r}), got {type(e).__name__}: {e}")
        return
    check(False, f"wanted {kind.__name__} ({text!r}), nothing raised")


q = torch.randn(2, 9, 4, 8)
k = torch.randn(2, 9, 2, 8)
E = loom.InvalidArgument
expect_error(E, "must be [B, S, H, D]", lambda: lt.attention(q[0], k[0], k[0]))
expect_error(E, "must be [T, H, D]", lambda: lt.attention(q, k, k, cu_seqlens=[0, 9]))
expect_error(E, "dtype torch.float64", lambda: lt.attention(q.double(), k.double(), k.double()))
expect_error(E, "dtype torch.int64", lambda: lt.attention(q.long(), k, k))
expect_error(E, "one dtype", lambda: lt.attention(q, k.bfloat16(), k))
expect_error(E, "not contiguous", lambda: lt.attention(q.transpose(1, 2), k, k))
expect_error(E, "must agree", lambda: lt.attention(q, torch.randn(2, 8, 2, 8), torch.randn(2, 8, 2, 8)))
expect_error(E, "k and v must have one shape", lambda: lt.attention(q, k, torch.randn(2, 9, 1, 8)))
expect_error(E, "multiple of the kv heads (3)", lambda: lt.attention(q, torch.randn(2, 9, 3, 8), torch.randn(2, 9, 3, 8)))
expect_error(E, "head_dim must be in [1, 256], got 300",
             lambda: lt.attention(torch.randn(1, 2, 1, 300), torch.randn(1, 2, 1, 300), torch.randn(1, 2, 1, 300)))
expect_error(E, "window must be None or a positive int, got 0", lambda: lt.attention(q, k, k, window=0))
expect_error(E, "window must be None or a positive int, got 2.5", lambda: lt.attention(q, k, k, window=2.5))
expect_error(E, "causal must be True or False", lambda: lt.attention(q, k, k, causal="yes"))
# numpy's bool is a bool (np.bool_(True) was refused as "got True").
import numpy as np  # noqa: E402
from fractions import Fraction  # noqa: E402
check(torch.equal(lt.attention(q, k, k, causal=np.bool_(False)), lt.attention(q, k, k, causal=False)),
      "causal=np.bool_(False) is causal=False")
expect_error(E, "scale must be", lambda: lt.attention(q, k, k, scale=float("nan")))
expect_error(E, "scale must be", lambda: lt.attention(q, k, k, scale=-1.0))
expect_error(E, "must be a torch.Tensor, got list", lambda: lt.attention([1.0], k, k))
qt = torch.randn(10, 4, 8)
kt = torch.randn(10, 2, 8)
expect_error(E, "cu_seqlens ends at 9", lambda: lt.attention(qt, kt, kt, cu_seqlens=[0, 4, 9]))
expect_error(E, "must start at 0", lambda: lt.attention(qt, kt, kt, cu_seqlens=[1, 10]))
expect_error(E, "document 1 has length 0", lambda: lt.attention(qt, kt, kt, cu_seqlens=[0, 4, 4, 10]))
expect_error(E, "1-d int32 or int64", lambda: lt.attention(qt, kt, kt, cu_seqlens=torch.tensor([0.0, 10.0])))
expect_error(E, "needs a process group", lambda: lt.cp_attention(q, k, k))
# A window past int64 is no window (it was a pybind TypeError, not loom's error).
check(torch.equal(lt.attention(q, k, k, window=2**70), lt.attention(q, k, k)), "window=2**70 is no window")
# Non-finite inputs are carried through as PyTorch's attention carries them: out, dq, dk and dv
# are NaN or Inf wherever the exact formula's are (loom's fp64 reference, row by row), and the
# other kv head stays finite. The kernels' online softmax once kept a NaN score out of its running
# max and took its exp as 0: the rows that saw a NaN key came out finite and wrong. S = 150 spans
# several tiles; the last case leaves a row only NaN keys (window 1).
gen = torch.Generator().manual_seed(5)
nan, inf = float("nan"), float("inf")
poisons = (("q", (0, 70, 1, 3), nan, None), ("k", (0, 10, 1, 5), nan, None),
           ("v", (0, 130, 0, 0), nan, None), ("k", (0, 40, 0, 2), inf, None),
           ("k", (0, 99, 1, 0), nan, 1))
for dt in (torch.float32, torch.bfloat16):
    for name, idx, val, win in poisons:
        t = {"q": torch.randn(1, 150, 4, 16, generator=gen), "k": torch.randn(1, 150, 2, 16, generator=gen),
             "v": torch.randn(1, 150, 2, 16, generator=gen)}
        t[name][idx] = val
        what = f"{str(dt)[6:]} {val} in {name}{list(idx)} window {win}"
        causal = win is None
        qq, kk, vv = (t[x].to(dt).clone().requires_grad_() for x in "qkv")
        o = lt.attention(qq, kk, vv, causal=causal, window=win)
        do = torch.randn(o.shape, generator=gen).to(dt)
        o.backward(do)
        qr, kr, vr = (t[x].to(dt).double().detach().requires_grad_() for x in "qkv")
        orf = lt.reference_attention(qr, kr, vr, causal=causal, window=win)
        orf.backward(do.double())
        group = idx[2] // 2 if name == "q" else idx[2]
        clean_q, clean_kv = [2 * (1 - group), 2 * (1 - group) + 1], [1 - group]
        check(not torch.isfinite(orf).all(), f"{what}: the formula's out is NaN somewhere")
        for nm, got, want, clean in (("out", o, orf, clean_q), ("dq", qq.grad, qr.grad, clean_q),
                                     ("dk", kk.grad, kr.grad, clean_kv), ("dv", vv.grad, vr.grad, clean_kv)):
            got = got.detach().float()
            miss = ~torch.isfinite(want) & torch.isfinite(got)
            check(not miss.any(), f"{what}: {nm} finite where the formula is not, first at "
                                  f"{miss.nonzero()[:1].tolist()}")
            check(torch.isfinite(got[:, :, clean]).all(), f"{what}: {nm} of the clean kv head finite")
# A row whose every visible score is -inf (an -inf in q against keys of one sign in that dim):
# the formula's softmax is 0 / 0, NaN, as PyTorch's eager attention says (the independent oracle
# here); loom read it as a row that sees no key: out 0, lse -inf, finite to a NaN check.
for dt in (torch.float32, torch.bfloat16):
    q1, k1, v1 = (torch.randn(1, 40, h, 8, generator=gen) for h in (2, 1, 1))
    q1[0, 5, 1, 2] = -inf
    k1[0, :, 0, 2] = k1[0, :, 0, 2].abs() + 0.1
    o1, l1 = lt.attention(q1.to(dt), k1.to(dt), v1.to(dt), return_lse=True)
    sc = torch.einsum("bshd,bthd->bhst", q1.to(dt).double(), k1.to(dt).double().expand(1, 40, 2, 8))
    pos = torch.arange(40)
    sc = sc.masked_fill(pos[None, :] > pos[:, None], -inf) / 8 ** 0.5
    eager = torch.einsum("bhst,bthd->bshd", torch.softmax(sc, -1), v1.to(dt).double().expand(1, 40, 2, 8))
    check(torch.isnan(eager[0, 5, 1]).all() and torch.isfinite(eager).sum() == 40 * 2 * 8 - 8,
          "the eager oracle: NaN in row 5 of head 1 only")
    check(torch.equal(torch.isnan(o1), torch.isnan(eager)), f"{dt}: -inf row: out NaN where eager's is")
    check(torch.isnan(l1[0, 1, 5]) and torch.isfinite(l1).sum() == 79, f"{dt}: -inf row: lse NaN there only")
    ref = lt.reference_attention(q1.to(dt).double(), k1.to(dt).double(), v1.to(dt).double())
    check(torch.equal(torch.isnan(ref), torch.isnan(eager)), f"{dt}: -inf row: the reference agrees")
# Under torch.autograd.detect_anomaly loom.torch refuses them instead, naming the tensor and where
# (the mode at the forward call decides for the backward too).
for dt in (torch.float32, torch.bfloat16):
    qn, kn, vn = q.to(dt), k.to(dt).clone(), k.to(dt).clone()
    kn[1, 3, 1, 5] = float("nan")
    vn[0, 0, 0, 0] = float("inf")
    with torch.autograd.detect_anomaly():
        expect_error(E, "k holds a NaN or Inf (row 12, head 1, dim 5 of this rank's [18, 2, 8]); "
                        "under torch.autograd.detect_anomaly loom.torch refuses non-finite inputs",
                     lambda: lt.attention(qn, kn, k.to(dt)))
        expect_error(E, "v holds a NaN or Inf (row 0, head 0, dim 0", lambda: lt.attention(qn, k.to(dt), vn))
        qg = q.to(dt).requires_grad_()
        o = lt.attention(qg, k.to(dt), k.to(dt))
        dn = torch.ones_like(o)
        dn[1, 8, 3, 7] = float("-inf")
        expect_error(E, "dout holds a NaN or Inf (row 17, head 3, dim 7", lambda: o.backward(dn))
    check(not torch.isfinite(lt.attention(qn, kn, k.to(dt))).all(), "outside anomaly mode: NaN out")
# The scale travels in fp32: values that round to 0 or overflow there are refused with the value
# given (they were reported as "got 0" and "got inf"); so is q with no tokens (it said "expected
# 16 x 2 x 8 elements, got 0").
expect_error(E, "scale must be within fp32's range for the kernels (1.1754944e-38 .. 2.3586574e+38), got 1e+39",
             lambda: lt.attention(q, k, k, scale=1e39))
# The range's ends as docs/python.md and the message give them run (q = 0 keeps the scores
# finite); one float32 past either is refused. With .6g the largest read 2.35866e+38, above
# itself: that number, passed back, was refused.
for s_ok in (2.3586574e38, 1.1754944e-38):
    check(torch.isfinite(lt.attention(torch.zeros_like(q), k, k, scale=s_ok)).all(), f"scale={s_ok}")
expect_error(E, "(1.1754944e-38 .. 2.3586574e+38), got 2.3586576e+38",
             lambda: lt.attention(q, k, k, scale=2.3586576e38))
expect_error(E, "(1.1754944e-38 .. 2.3586574e+38), got 2.35866e+38",
             lambda: lt.attention(q, k, k, scale=2.35866e38))
expect_error(E, "got 1.1754942e-38", lambda: lt.attention(q, k, k, scale=1.1754942e-38))
expect_error(E, "got 1e-46", lambda: lt.attention(q, k, k, scale=1e-46))
# Subnormal in fp32 (9.8e-45): dq and dk came back 40 % off, silently.
expect_error(E, "got 1e-44", lambda: lt.attention(q, k, k, scale=1e-44))
expect_error(E, "scale must be None or a positive finite number", lambda: lt.attention(q, k, k, scale=10**400))
z = torch.zeros(0, 16, 2, 8)
expect_error(E, "q holds no tokens (shape [0, 16, 2, 8])", lambda: lt.attention(z, z, z))
# The backward is not differentiable: every route to a second derivative raises NotSupported
# naming the op (jvp, hvp and hessian returned zeros, a gradient penalty's autograd.grad the
# first-order part alone, gradgradcheck a Jacobian mismatch: torch's once_differentiable node hung
# on detached leaves that these routes prune), and nothing else changes (common.py).
gen2 = torch.Generator().manual_seed(11)
q2, k2, v2 = (torch.randn(1, 3, h, 2, generator=gen2) for h in (2, 1, 1))
check_second_derivatives(check, lt.attention, "the backward of attention", q2, k2, v2)
check_second_derivatives(check, lt.reference_attention, "the backward of reference_attention",
                         *(x.double() for x in (q2, k2, v2)))
# Tensors whose bytes are not their values: a lazy negation view (read raw: a wrong answer) and
# sparse tensors (a raw torch error) are refused; a dout that is a lazy negation is resolved.
expect_error(E, "v is a lazy negation view; call .resolve_neg()",
             lambda: lt.attention(q, k, torch._neg_view(k)))
expect_error(E, "q has layout torch.sparse_coo; loom.torch takes dense (strided) tensors",
             lambda: lt.attention(q.to_sparse(), k, k))
q2 = torch.randn(q.shape, requires_grad=True)
d2 = torch.randn(q.shape)
lt.attention(q2, k.detach(), k.detach()).backward(torch._neg_view(d2))
g_neg = q2.grad.clone()
q2.grad = None
lt.attention(q2, k.detach(), k.detach()).backward(-d2)
check(torch.equal(g_neg, q2.grad), "a dout that is a lazy negation view: the gradient of -dout")
# out and lse are the caller's own: out is no view of a hidden tensor (modifying it in place was
# refused as "a view ... being modified inplace"; now autograd's version check guards the saved
# out, as for any saved tensor), and lse modified in place leaves the backward intact (for thd and
# B = 1 it was the tensor saved for the backward, so the backward refused to run).
x2 = torch.randn(1, 8, 2, 4, requires_grad=True)
o2 = lt.attention(x2 * 1, x2 * 1, x2 * 1)
check(o2._base is None, "out is not a view")
o2 += x2
expect_error(RuntimeError, "modified by an inplace operation", lambda: o2.sum().backward())
for cu in (None, [0, 8]):
    q2 = torch.randn(8, 2, 4) if cu else torch.randn(1, 8, 2, 4)
    q2.requires_grad_()
    o2, l2 = lt.attention(q2, q2, q2, cu_seqlens=cu, return_lse=True)
    l2.mul_(0)
    o2.sum().backward()
    check(q2.grad is not None and torch.isfinite(q2.grad).all(), f"lse modified in place, cu_seqlens {cu}")
if torch.cuda.is_available():
    expect_error(loom.NotSupported, "CPU tensors only", lambda: lt.attention(q.cuda(), k.cuda(), k.cuda()))
else:
    # No GPU on this machine: a meta-device tensor stands in for any non-CPU device.
    expect_error(loom.NotSupported, "CPU tensors only",
                 lambda: lt.attention(q.to("meta"), k, k))
check(issubclass(loom.NotSupported, NotImplementedError) and issubclass(loom.InvalidArgument, ValueError)
      and issubclass(loom.Timeout, loom.CommError), "error classes")

# loom.torch.verify: loom's own results pass (forward and backward); the first seed's ring loop
# (partial outputs of two KV blocks added with no log-sum-exp merge) fails and is named.
gen = torch.Generator().manual_seed(11)
S, H, HKV, D = 64, 4, 2, 16
q, k, v, do = (torch.randn(shape, generator=gen) for shape in ((S, H, D), (S, HKV, D), (S, HKV, D), (S, H, D)))
q4, k4, v4 = (x[None].clone().requires_grad_() for x in (q, k, v))
o4, l4 = lt.attention(q4, k4, v4, causal=True, return_lse=True)
o4.backward(do[None])
rep = lt.verify(o4[0], q, k, v, dout=do, lse=l4[0], dq=q4.grad[0], dk=k4.grad[0], dv=v4.grad[0],
                layout="zigzag", ranks=2)
check(rep["passed"] and rep["absent"] == [] and all(t["passed"] for t in rep["tensors"]),
      f"verify passes loom's own out/lse/dq/dk/dv: {rep['tensors']}")
kk = k.repeat_interleave(H // HKV, dim=1)
vv = v.repeat_interleave(H // HKV, dim=1)
seed = torch.zeros(S, H, D)
i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
for lo, hi in ((0, S // 2), (S // 2, S)):
    sc = torch.einsum("shd,thd->hst", q, kk) / D ** 0.5
    sc = sc.masked_fill(~((j <= i) & (j >= lo) & (j < hi)), float("-inf"))
    seed += torch.einsum("hst,thd->shd", torch.softmax(sc, -1).nan_to_num(0.0), vv)
rep = lt.verify(seed, q, k, v, layout="contiguous", ranks=2)
kinds = [d["kind"] for d in rep["diagnoses"]]
check(not rep["passed"] and kinds[:1] == ["no_lse_merge"],
      f"verify names the seed loop's missing log-sum-exp merge: {kinds}")
rep = lt.verify(o4[0] * (1 + 1e-3), q, k, v)
check(not rep["passed"], "verify fails an out 0.1 % off")
expect_error(E, "pass dout", lambda: lt.verify(o4[0], q, k, v, dq=q4.grad[0]))
expect_error(E, "ranks must be", lambda: lt.verify(o4[0], q, k, v, ranks=0))
# The messages name verify's parameters: an unknown layout was the engine's "unknown convention
# 'spiral'" (loom verify's --convention), and dk, dv alone above the full-check limit pointed to
# --full-check-max, which verify() did not take: it takes full_check_max= now, and the message
# names that (S = 4097, H = D = 1: cheap).
expect_error(E, "verify: unknown layout 'spiral' (choose contiguous, zigzag, stripe, rfa-zigzag, "
                "te-thd, torch-headtail or megatron)",
             lambda: lt.verify(o4[0], q, k, v, layout="spiral", ranks=2))
q1 = torch.randn(4097, 1, 1, generator=gen)
expect_error(E, "nothing could be compared: dk and dv need every query row, and S = 4097 is above "
                "the full-check limit of 4096 tokens (full_check_max=4096); give out, lse or dq "
                "too, or raise the limit",
             lambda: lt.verify(None, q1, q1, q1, dout=q1, dk=q1, dv=q1))
expect_error(E, "full_check_max must be a positive int (at most 2^62), got 0",
             lambda: lt.verify(None, q1, q1, q1, dout=q1, dk=q1, dv=q1, full_check_max=0))
# Raised, the same dk and dv are compared (every row): all-ones gradients are found wrong.
ones = torch.ones_like(q1)
rep = lt.verify(None, q1, q1, q1, dout=q1, dk=ones, dv=ones, full_check_max=4097)
check(not rep["passed"] and all(t["compared"] for t in rep["tensors"]),
      f"full_check_max=4097 compares dk and dv at S = 4097 (and finds ones wrong): {rep['tensors']}")
# verify's arguments: each bad one is loom's one-line error (these were pybind TypeErrors, an
# AttributeError, torch's RuntimeError, or accepted: a complex out cut to its real part, int q).
expect_error(E, "ranks must be a positive int (at most 2^31 - 1)", lambda: lt.verify(o4[0], q, k, v, ranks=2**40))
expect_error(E, "dtype must be None, 'fp32' or 'bf16', got 16", lambda: lt.verify(o4[0], q, k, v, dtype=16))
expect_error(E, "layout must be a string, got None", lambda: lt.verify(o4[0], q, k, v, layout=None))
expect_error(E, "out must be a torch.Tensor, got list", lambda: lt.verify([1.0], q, k, v))
expect_error(loom.NotSupported, "lse is on meta", lambda: lt.verify(o4[0], q, k, v, lse=l4[0].to("meta")))
expect_error(E, "out has dtype torch.complex64", lambda: lt.verify(o4[0].to(torch.complex64), q, k, v))
expect_error(E, "q has dtype torch.int32", lambda: lt.verify(o4[0], q.int(), k, v))
# More ranks than tokens (as loom verify: 2^31 - 1 ran out of memory, 17 over 16 tokens passed);
# a float16 result (held to fp32's tolerance, a correct one always failed); lse's own shapes.
expect_error(E, f"ranks must be in [1, {q.shape[0]}] (at most the sequence length",
             lambda: lt.verify(o4[0], q, k, v, ranks=q.shape[0] + 1))
expect_error(E, "out is float16; verify has tolerances for fp32 and bf16 results only",
             lambda: lt.verify(o4[0].half(), q, k, v))
check("tensors" in lt.verify(o4[0], q.half(), k.half(), v.half()), "float16 inputs (q, k, v) are taken")
# bf16 gradients take bf16's tolerances by default, with out=None or an fp32 out (the dtype came
# from out alone: they were held to 1e-5 and failed); held to fp32's on request, the diagnosis
# names bf16 storage in verify's own spelling (it said "no known defect explains the dq error").
gb = [x.grad[0].bfloat16() for x in (q4, k4, v4)]
for out in (None, o4[0]):
    rep = lt.verify(out, q, k, v, dout=do, dq=gb[0], dk=gb[1], dv=gb[2], layout="zigzag", ranks=2)
    check(rep["passed"] and all(t["tolerance"] == 2.0 ** -7 for t in rep["tensors"] if t["compared"]),
          f"bf16 dq, dk, dv (out {None if out is None else out.dtype}) get bf16's tolerances: {rep['tensors']}")
rep = lt.verify(None, q, k, v, dout=do, dq=gb[0], dk=gb[1], dv=gb[2], layout="zigzag", ranks=2,
                dtype="fp32")
check(not rep["passed"] and rep["diagnoses"][0]["kind"] == "bf16_storage"
      and "dq, dk and dv are stored in bf16" in rep["diagnoses"][0]["text"]
      and 'check it with dtype="bf16"' in rep["diagnoses"][0]["text"],
      f"bf16 gradients held to fp32's tolerances are named bf16 storage: {rep['diagnoses']}")
expect_error(E, "lse has shape [2, 4, 1]; pass one sequence ([H, S] or [1, H, S])",
             lambda: lt.verify(o4[0], q, k, v, lse=torch.zeros(2, 4, 1)))
# The [1, H, S] lse that attention() returns for [1, S, H, D] inputs is taken as it is.
check(lt.verify(o4, q4.detach(), k4.detach(), v4.detach(), lse=l4)["passed"], "verify takes attention()'s bshd lse")
expect_error(E, "shard needs a process group", lambda: lt.shard(q))
expect_error(E, "set_timeout needs a process group", lambda: lt.set_timeout(3))
# set_timeout takes what LOOM_TIMEOUT_S takes, 0.001 to 1e9 s (1e-12 and 5e-324 were taken),
# checked before the group is looked for, with the engine's rule and message (the value as it
# reads back: "1e+09" was printed for one just above 1e9). A one-process gloo group (never
# registered with torch.distributed) shows that the accepted values reach the engine unchanged.
for bad, text in ((1e-12, "1e-12"), (5e-324, "5e-324"), (0.000999, "0.000999"), (-1.0, "-1"),
                  (0, "0"), (1e9 * (1 + 1e-15), "1000000000.000001"), (float("nan"), "nan"),
                  (float("-inf"), "-inf"),
                  # Past float's range, named as given (it read "got inf" and "got -inf").
                  (10**400, "100000000000... (401 digits), beyond float's range"),
                  (-10**400, "-100000000000... (401 digits), beyond float's range"),
                  (Fraction(10**400, 3),
                   "Fraction(100000000000000... (414 characters), beyond float's range")):
    expect_error(E, f"timeout must be from 0.001 to 1e9 seconds, got {text}",
                 lambda: lt.set_timeout(bad))
for bad in (True, "3", None, torch.tensor(3.0)):
    expect_error(E, f"timeout must be a number of seconds, got {bad!r}",
                 lambda: lt.set_timeout(bad))
one_rank = torch.distributed.ProcessGroupGloo(torch.distributed.HashStore(), 0, 1)
for good in (0.001, 1, 2.5, 1e9):
    lt.set_timeout(good, one_rank)
    got = lt._group(one_rank).timeout_s
    check(got == good, f"set_timeout({good!r}) sets timeout_s {got!r}")
expect_error(E, "got 1e-12", lambda: lt.set_timeout(1e-12, one_rank))
expect_error(E, "got 1e-12", lambda: setattr(lt._group(one_rank), "timeout_s", 1e-12))
check(lt._group(one_rank).timeout_s == 1e9, "a refused timeout leaves the group's timeout as it was")
# LOOM_TIMEOUT_S holding a value loom refuses: a valid set_timeout on a group loom meets first
# raised the variable's message (loom read it for every group it made, a timeout given or not):
# the group now takes the timeout given; a group made without one still refuses the variable.
timeout_env = os.environ.get("LOOM_TIMEOUT_S")
os.environ["LOOM_TIMEOUT_S"] = "abc"
fresh = torch.distributed.ProcessGroupGloo(torch.distributed.HashStore(), 0, 1)
lt.set_timeout(2.5, fresh)
check(lt._group(fresh).timeout_s == 2.5, "set_timeout on a new group, LOOM_TIMEOUT_S=abc")
expect_error(E, "LOOM_TIMEOUT_S must be a decimal number of seconds from 0.001 to 1e9, got 'abc'",
             lambda: lt._group(torch.distributed.ProcessGroupGloo(
                 torch.distributed.HashStore(), 0, 1)))
lt.set_timeout(2.5, one_rank)  # a group loom has made already takes it
check(lt._group(one_rank).timeout_s == 2.5, "set_timeout on a group loom holds, LOOM_TIMEOUT_S=abc")
if timeout_env is None:
    del os.environ["LOOM_TIMEOUT_S"]
else:
    os.environ["LOOM_TIMEOUT_S"] = timeout_env

# vmap: a batched tensor has no storage, and the kernels' call raised torch's raw "Cannot access
# data pointer of Tensor that doesn't have storage". jacobian(vectorize=True) batches dout (the
# backward of each op); vmap batches q (the forward). vectorize=False runs, and its jacobian is the
# fp64 reference's.
qj, kj = torch.randn(1, 4, 2, 2, generator=gen), torch.randn(1, 4, 1, 2, generator=gen)
jac = torch.autograd.functional.jacobian
vmap_text = ("is a vmap's batched tensor, with no storage for loom's kernels to read: loom.torch "
             "does not support vmap, which torch.autograd.functional.jacobian and hessian use with "
             "vectorize=True and torch.autograd.grad with is_grads_batched=True; call them with "
             "vectorize=False / is_grads_batched=False")
for name, fn in (("attention", lambda x: lt.attention(x, kj, kj)),
                 ("reference_attention", lambda x: lt.reference_attention(x, kj, kj)),
                 ("cp_attention", lambda x: lt.cp_attention(x, kj, kj, group=one_rank))):
    expect_error(loom.NotSupported, f"the backward of {name}: dout {vmap_text}",
                 lambda: jac(fn, qj, vectorize=True))
j32 = jac(lambda x: lt.attention(x, kj, kj), qj)
j64 = jac(lambda x: lt.reference_attention(x, kj.double(), kj.double()), qj.double())
check(rel_error(j32, j64) <= 1e-5, f"jacobian(vectorize=False): {rel_error(j32, j64):.3g}")
vmap = getattr(torch, "vmap", None) or torch._vmap_internals.vmap  # torch.vmap from torch 2.0
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch 1.13's vmap: "use functorch.vmap"
    q3 = qj[None].expand(3, -1, -1, -1, -1)  # three [1, 4, 2, 2] q's, batched
    expect_error(loom.NotSupported, f"q {vmap_text}", lambda: vmap(lambda x: lt.attention(x, kj, kj))(q3))


# A Timeout (or CommError) names the loom.torch call it came from and the setting that bounds it;
# the engine's text alone read the same in a forward and a backward. Two ranks of a gloo group in
# two threads of this process (its waits release the GIL); rank 1 leaves rank 0 to wait 0.3 s: in
# cp_attention's forward, in its backward (after a forward both ranks made), in unshard. A timeout
# leaves a group unusable, so each case has its own.
def two_ranks():
    store, pgs = torch.distributed.HashStore(), [None, None]

    def make(r):
        pgs[r] = torch.distributed.ProcessGroupGloo(store, r, 2)
    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return pgs


def both(fn):
    threads = [threading.Thread(target=fn, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def expect_timeout(call, fn):
    """fn raises loom.Timeout: `call: ` + the engine's text (rank 0: all_gather: send to rank 1
    timed out after 0.2998 s (the torch group of 2 ranks), the rest of the collective's limit of
    0.3 s) + the setting."""
    knob = ("(the torch group of 2 ranks), the rest of the collective's limit of 0.3 s; loom's "
            "timeout is LOOM_TIMEOUT_S or loom.torch.set_timeout")
    try:
        fn()
    except loom.Timeout as e:
        check(str(e).startswith(f"{call}: rank 0: all_gather: ") and "rank 1 timed out after 0."
              in str(e) and str(e).endswith(knob),
              f"a Timeout names the call ({call}) and the setting: {e}")
        return
    except Exception as e:  # noqa: BLE001
        check(False, f"{call}: wanted loom.Timeout, got {type(e).__name__}: {e}")
        return
    check(False, f"{call}: wanted loom.Timeout, nothing raised")


qc = [torch.randn(1, 4, 2, 4, generator=gen) for _ in (0, 1)]  # each rank its own shard
pgs = two_ranks()
lt.set_timeout(0.3, pgs[0])
expect_timeout("cp_attention (the forward)", lambda: lt.cp_attention(qc[0], qc[0], qc[0], pgs[0]))
expect_error(loom.CommError, "cp_attention (the forward): rank 0: all_gather: this communicator "
             "failed earlier", lambda: lt.cp_attention(qc[0], qc[0], qc[0], pgs[0]))
pgs = two_ranks()
outs = [None, None]
leaves = [x.clone().requires_grad_() for x in qc]
both(lambda r: outs.__setitem__(r, lt.cp_attention(leaves[r], qc[r], qc[r], pgs[r])))
check(outs[0] is not None and outs[1] is not None, "two ranks' forward in threads")
lt.set_timeout(0.3, pgs[0])
expect_timeout("the backward of cp_attention", lambda: outs[0].sum().backward())
pgs = two_ranks()
lt.set_timeout(0.3, pgs[0])
expect_timeout("unshard", lambda: lt.unshard(qc[0], pgs[0]))

print(f"test_single: {check.count} checks, {len(check.failures)} failures", flush=True)
sys.exit(1 if check.failures else 0)
