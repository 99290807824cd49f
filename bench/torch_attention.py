"""PyTorch's own attention: the PyTorch side of loom's benchmarks.

bench/torch_compare.py (bench_kernels' PyTorch rows) and bench/bench_torch_binding.py (vs-torch)
time PyTorch through `attention` here, so that loom is measured against PyTorch's own attention
and not only against one formulation of it:

- `sdpa` (the default here): PyTorch's scaled dot product attention,
  torch.nn.functional.scaled_dot_product_attention (PyTorch >= 2.0) or its 1.13 form
  torch.nn.functional._scaled_dot_product_attention, which returns (output, weights). On CPU in
  1.13 it is materialised (scores, softmax, @ v), with its own causal path.
- `textbook`: matmul(q, k^T) * scale, masked, softmax, @ v: the scale applied to the S x S scores
  (an extra pass over them). It is all that bench/torch_compare.py timed before 2026-12-04.
Which one is faster depends on the kernel and the minute (docs/performance.md, round 15), so
torch_compare.py times both by default and keeps each kernel's faster.

Tensors are [..., S, D] (any leading dimensions, the same for q, k and v). Causal follows loom's
convention: the Sq queries are the last Sq positions of the Sk keys, so query i sees keys
[0, Sk - Sq + i]. PyTorch's is_causal aligns the first query with the first key (top-left), so it
is used only where Sq == Sk (where the two agree), and an explicit boolean mask elsewhere.
"""
import math

IMPLS = ("sdpa", "textbook")


def _sdpa_function():
    import torch.nn.functional as F
    if hasattr(F, "scaled_dot_product_attention"):  # PyTorch >= 2.0: returns the output
        return F.scaled_dot_product_attention, False
    return F._scaled_dot_product_attention, True  # PyTorch 1.13: returns (output, weights)


def describe(impl):
    """The name of what `impl` runs, for the benchmarks' headers and JSON."""
    if impl == "textbook":
        return "textbook (matmul, * scale, masked_fill, softmax, matmul)"
    fn, _ = _sdpa_function()
    return f"sdpa (torch.nn.functional.{fn.__name__})"


def _visible(sq, sk, device=None):
    """[sq, sk] booleans, True where query i (position sk - sq + i) sees key j (j <= position)."""
    import torch
    qpos = torch.arange(sk - sq, sk, device=device).unsqueeze(1)
    kpos = torch.arange(sk, device=device).unsqueeze(0)
    return kpos <= qpos


def attention(q, k, v, causal, impl="sdpa"):
    """softmax(q k^T / sqrt(D) (+ causal mask)) v for [..., S, D] q, k, v, through `impl`."""
    import torch
    sq, sk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if impl == "textbook":
        s = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
        if causal:
            s = s.masked_fill(~_visible(sq, sk, q.device), float("-inf"))
        return torch.matmul(torch.softmax(s, dim=-1), v)
    if impl != "sdpa":
        raise ValueError(f"unknown PyTorch attention {impl!r} (accepted: {', '.join(IMPLS)})")
    fn, returns_pair = _sdpa_function()
    if causal and sq == sk:
        out = fn(q, k, v, None, 0.0, False, True) if returns_pair else fn(q, k, v, is_causal=True)
    else:
        mask = _visible(sq, sk, q.device) if causal else None
        out = fn(q, k, v, mask, 0.0, False, False) if returns_pair else fn(q, k, v, attn_mask=mask)
    return out[0] if returns_pair else out


def check(impl):
    """Compares `attention` in fp32 with an fp64 softmax(q k^T / sqrt(D)) v on small shapes (full,
    causal, causal with fewer queries than keys). Returns (the worst relative norm error, NaN
    where one is NaN, and its case's name); the caller fails unless it is <= 1e-5 (loom's fp32
    tolerance, kFp32RelTol of tests/unit/tolerance.h)."""
    import torch
    g = torch.Generator().manual_seed(7)
    worst, where = 0.0, ""
    for sq, sk, causal in ((64, 64, False), (64, 64, True), (48, 80, True)):
        q = torch.randn(2, sq, 32, generator=g, dtype=torch.float64)
        k = torch.randn(2, sk, 32, generator=g, dtype=torch.float64)
        v = torch.randn(2, sk, 32, generator=g, dtype=torch.float64)
        s = q @ k.transpose(-1, -2) / math.sqrt(32)
        if causal:  # written out here, not _visible: the check must not share what it checks
            for i in range(sq):
                s[:, i, sk - sq + i + 1:] = float("-inf")
        ref = torch.softmax(s, dim=-1) @ v
        with torch.no_grad():
            got = attention(q.float(), k.float(), v.float(), causal, impl).double()
        err = float((got - ref).norm() / ref.norm())
        if math.isnan(err) or err > worst:
            worst, where = err, f"Sq={sq} Sk={sk} {'causal' if causal else 'full'}"
        if math.isnan(err):
            break
    return worst, where
