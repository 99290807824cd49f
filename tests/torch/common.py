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
