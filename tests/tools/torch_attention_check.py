#!/usr/bin/python3
"""Checks bench/torch_attention.py, the PyTorch side of loom's benchmarks.

  torch_attention_check.py

- Both formulations (sdpa, PyTorch's scaled dot product attention, and textbook) agree with an
  fp64 softmax(q k^T / sqrt(D)) v within loom's fp32 tolerance (1e-5 relative), on the full,
  causal and fewer-queries-than-keys causal cases of its check(), and on fresh random inputs here
  (leading dimensions [B, H], Sq < Sk causal: loom's bottom-right alignment).
- The check can fail: with the causal mask aligned top-left (PyTorch's is_causal convention, wrong
  for Sq < Sk under loom's), check() reports an error above the tolerance and names that case.
- The benchmarks' default is sdpa, and an unknown formulation is a ValueError.
Exit 0 when all hold, else 1 with one line per failure.
"""
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import torch  # noqa: E402
import torch_attention  # noqa: E402

TOL = 1e-5  # kFp32RelTol of tests/unit/tolerance.h


def reference(q, k, v, causal):
    sq, sk = q.shape[-2], k.shape[-2]
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:  # query i is position sk - sq + i
        hide = torch.arange(sk)[None, :] > torch.arange(sk - sq, sk)[:, None]
        s = s.masked_fill(hide, float("-inf"))
    return torch.softmax(s, dim=-1) @ v.double()


def main():
    bad = []
    for impl in torch_attention.IMPLS:
        err, case = torch_attention.check(impl)
        if not err <= TOL:
            bad.append(f"{impl}: check() error {err:.3g} at {case} (limit {TOL})")
        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        for sq, sk, causal in ((96, 96, False), (96, 96, True), (40, 136, True), (136, 136, True)):
            q = torch.randn(2, 3, sq, 48, generator=g)
            k = torch.randn(2, 3, sk, 48, generator=g)
            v = torch.randn(2, 3, sk, 48, generator=g)
            ref = reference(q, k, v, causal)
            with torch.no_grad():
                got = torch_attention.attention(q, k, v, causal, impl).double()
            err = float((got - ref).norm() / ref.norm())
            if not err <= TOL:
                bad.append(f"{impl} Sq={sq} Sk={sk} causal={causal}: error {err:.3g}")
    # A wrong alignment must be caught: PyTorch's top-left causal mask for every shape.
    right = torch_attention._visible
    torch_attention._visible = lambda sq, sk, device=None: torch.ones(
        sq, sk, dtype=torch.bool, device=device).tril()
    try:
        err, case = torch_attention.check("sdpa")
    finally:
        torch_attention._visible = right
    if err <= TOL or "Sq=48 Sk=80" not in case:
        bad.append(f"a top-left causal mask passed check(): error {err:.3g} at {case!r}")
    try:
        torch_attention.attention(q, k, v, False, "fused")
        bad.append("an unknown formulation was accepted")
    except ValueError as e:
        if "sdpa" not in str(e):
            bad.append(f"the unknown formulation's error does not name the choices: {e}")
    import inspect
    if inspect.signature(torch_attention.attention).parameters["impl"].default != "sdpa":
        bad.append("attention()'s default is not sdpa")
    if bad:
        print("\n".join(bad))
        return 1
    print(f"torch_attention: {', '.join(torch_attention.IMPLS)} within {TOL} of fp64; "
          f"a top-left causal mask caught ({err:.2g} at {case})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
