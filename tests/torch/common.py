"""Shared by the loom.torch tests: a check counter, tolerances, an independent fp64 attention
written with plain torch ops (no loom code), error measures and seeded inputs.

Tolerances are the ones written down in tests/unit/tolerance.h (relative norm error against the
fp64 reference on the same input values), never loosened to make a test pass:
  fp32  out, dq, dk, dv, lse            1e-5                 (kFp32RelTol)
  bf16  out (bf16)                      2u, u = 2^-8         (kBf16OutRelTol)
        dq, dk                          2u + u               (kBf16GradRelTol, plus the one
                                                              rounding of the fp32 gradient to
                                                              the bf16 .grad torch keeps:
                                                              |error| <= u |x| per element)
        dv                              2u + u               (kBf16GradRelTol: the avx512bf16
                                                              path rounds p for p^T dout; plus
                                                              that rounding)
        lse                             1e-5                 (kFp32RelTol; lse is fp32)
The fixed bf16 bounds hold for random normal inputs with at least ~100 keys per row on average
(tolerance.h); the bf16 cases are sized for that.
"""
import math

import torch


class Checks:
    """A test script's checks: check(ok, what) counts one; a false ok prints prefix + "FAIL what"
    and keeps `what` in .failures."""

    def __init__(self, prefix=""):
        self.count = 0
        self.failures = []
        self.prefix = prefix

    def __call__(self, ok, what):
        self.count += 1
        if not ok:
            self.failures.append(what)
            print(f"{self.prefix}FAIL {what}", flush=True)


FP32_REL_TOL = 1e-5
BF16_U = 1.0 / 256.0
TOL = {
    torch.float32: {"out": FP32_REL_TOL, "dq": FP32_REL_TOL, "dk": FP32_REL_TOL,
                    "dv": FP32_REL_TOL, "lse": FP32_REL_TOL},
    torch.bfloat16: {"out": 2 * BF16_U, "dq": 3 * BF16_U, "dk": 3 * BF16_U,
                     "dv": 3 * BF16_U, "lse": FP32_REL_TOL},
}


def rel_error(x, ref):
    """||x - ref|| / ||ref|| in fp64 (||x|| when ref is zero); inf when x is not finite."""
    x = x.detach().double()
    ref = ref.detach().double()
    if x.shape != ref.shape:
        return math.inf
    if not torch.isfinite(x).all():
        return math.inf
    norm = ref.norm().item()
    err = (x - ref).norm().item()
    return err / norm if norm > 0 else err


def torch_attention_fp64(q, k, v, causal, window, doc_ids, scale):
    """Independent fp64 attention: q [N, H, D], k, v [N, Hkv, D] of one packed sequence whose
    token n has position pos[n] within document doc_ids[n]. Plain torch ops, autograd for the
    gradients. Returns out [N, H, D] and lse [H, N]."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    kx = k.repeat_interleave(group, dim=1)  # [N, H, D]
    vx = v.repeat_interleave(group, dim=1)
    s = torch.einsum("ihd,jhd->hij", q, kx) * scale
    idx = torch.arange(n)
    # position of each token within its document
    starts = torch.zeros(n, dtype=torch.long)
    for i in range(1, n):
        starts[i] = starts[i - 1] if doc_ids[i] == doc_ids[i - 1] else i
    pos = idx - starts
    same = doc_ids[:, None] == doc_ids[None, :]
    allowed = same.clone()
    if causal:
        allowed &= pos[None, :] <= pos[:, None]
    if window:
        allowed &= (pos[:, None] - pos[None, :]).abs() < window
    s = s.masked_fill(~allowed[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, N]
    p = torch.exp(s - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0)
    out = torch.einsum("hij,jhd->ihd", p, vx)
    return out, lse


def doc_ids_for(batch, seq, docs):
    """Document id of each row of the packed sequence (bshd: one per batch row)."""
    if batch:
        return torch.arange(batch).repeat_interleave(seq)
    return torch.cat([torch.full((l,), i, dtype=torch.long) for i, l in enumerate(docs)])


def normal(shape, gen, dtype):
    """Seeded N(0, 1) values stored in dtype (bf16: rounded once)."""
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def check_second_derivatives(check, fn, who, q, k, v):
    """Every route to a second derivative through fn(q, k, v) (an op returning out) must raise
    loom.NotSupported naming `who` (torch's once_differentiable node hung on detached leaves,
    which these routes pruned: jvp, hvp and hessian returned zeros, a penalty's autograd.grad a
    partial result, without an error); first gradients under create_graph=True are the plain
    ones, and a second derivative that bypasses the op, or a graph without it, is torch's.
    q, k, v: plain tensors of one float dtype. Collective for cp_attention: every rank calls it
    alike (each route's calls are the same on every rank)."""
    import warnings

    import loom

    F = torch.autograd.functional
    dtype, dim = q.dtype, q.shape[-1]
    gen = torch.Generator().manual_seed(3)
    t = torch.randn(q.shape, generator=gen).to(dtype)
    leaf = lambda x: x.detach().clone().requires_grad_()  # noqa: E731

    def penalty_q():
        a = leaf(q)
        g, = torch.autograd.grad(fn(a, k, v).pow(2).sum(), a, create_graph=True)
        return torch.autograd.grad(g.pow(2).sum(), a)

    def penalty_upstream():
        # A gradient penalty w.r.t. the input x of a Linear that makes q: its gradient w.r.t. the
        # Linear's weight was the first-order part alone (0.091 where eager attention gives 0.146).
        lin = torch.nn.Linear(dim, dim).to(dtype)
        x = leaf(torch.randn(q.shape, generator=gen).to(dtype))
        gx, = torch.autograd.grad(fn(lin(x), k, v).pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum(), [lin.weight], allow_unused=True)

    def backward_twice():
        a = leaf(q)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch: "backward() with create_graph=True ... cycle"
            fn(a, k, v).pow(2).sum().backward(create_graph=True)
        a.grad.pow(2).sum().backward()

    def linear_loss():
        # dout carries no graph: torch's own decorator looked only at dout.
        a = leaf(q)
        g, = torch.autograd.grad((fn(a, k, v) * t).sum(), a, create_graph=True)
        check(g.requires_grad, f"{who}: a create_graph gradient of a linear loss has a graph")
        (g * g).sum().backward()

    def gradgradcheck():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "not of double precision" for fp32 inputs
            return torch.autograd.gradgradcheck(lambda a, b, c: fn(a, b, c),
                                                (leaf(q), leaf(k), leaf(v)))

    routes = (("jvp", lambda: F.jvp(lambda a: fn(a, k, v), q, t)),
              ("jvp strict", lambda: F.jvp(lambda a: fn(a, k, v), q, t, strict=True)),
              ("hvp", lambda: F.hvp(lambda a: fn(a, k, v).pow(2).sum(), q, t)),
              ("vhp", lambda: F.vhp(lambda a: fn(a, k, v).pow(2).sum(), q, t)),
              ("hessian", lambda: F.hessian(lambda a: fn(a, k, v).pow(2).sum(), q)),
              ("gradgradcheck", gradgradcheck),
              ("autograd.grad(penalty, q)", penalty_q),
              ("autograd.grad(penalty, [upstream weight])", penalty_upstream),
              ("backward(create_graph=True), then backward()", backward_twice),
              ("a loss linear in out", linear_loss))
    text = f"{who} is once differentiable: a second derivative through it"
    for name, route in routes:
        try:
            got = route()
        except loom.NotSupported as e:
            check(str(e).startswith(text) and "\n" not in str(e), f"{who}, {name}: {e}")
            continue
        except Exception as e:  # noqa: BLE001
            check(False, f"{who}, {name}: wanted loom.NotSupported, got {type(e).__name__}: {e}")
            continue
        check(False, f"{who}, {name}: wanted loom.NotSupported, got a result without an error "
                     f"({type(got).__name__})")

    # First gradients under create_graph=True are the plain ones.
    a, b = leaf(q), leaf(q)
    plain, = torch.autograd.grad(fn(a, k, v).pow(2).sum(), a)
    graphed, = torch.autograd.grad(fn(b, k, v).pow(2).sum(), b, create_graph=True)
    check(torch.equal(plain, graphed.detach()) and graphed.requires_grad,
          f"{who}: create_graph=True gives the plain first gradient, with a graph")
    # A second derivative that does not pass through the op: d2/dw2 of sum(w^3) is 6 w.
    w = torch.tensor([0.5, -1.0, 2.0], dtype=dtype, requires_grad=True)
    a = leaf(q)
    gq, gw = torch.autograd.grad(fn(a, k, v).pow(2).sum() + w.pow(3).sum(), [a, w],
                                 create_graph=True)
    hw, = torch.autograd.grad(gw.sum(), w)
    check(torch.equal(gq.detach(), plain) and torch.allclose(hw, 6 * w.detach()),
          f"{who}: a second derivative beside the op: {hw.tolist()}, wanted {(6 * w).tolist()}")
    # A graph without the op (its inputs require no grad): hessian is torch's.
    h = F.hessian(lambda x: x.pow(3).sum() + fn(q, k, v).sum(), w.detach())
    check(torch.allclose(h, torch.diag(6 * w.detach())), f"{who}: hessian beside the op: {h}")
