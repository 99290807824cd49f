#!/usr/bin/python3
"""An independent float64 attention in NumPy, to check `loom attn --output` files.

  npy_attention.py make DIR --seq S --heads H --kv-heads HKV --head-dim D [--seed N]
      writes random q.npy, k.npy, v.npy, dout.npy (float32) into DIR
  npy_attention.py check IN OUT [--no-causal] [--window W] [--docs L1,L2] [--backward]
      recomputes out, lse (and dq, dk, dv) from IN in float64 and compares OUT's files;
      exits 1 when a normwise relative error exceeds --tol (default 1e-5)

Written from the definitions only (softmax(scale q k^T + mask) v and its gradients), sharing no
code with loom.
"""
import argparse
import sys

import numpy as np


def mask_matrix(S, causal, window, docs):
    i = np.arange(S)[:, None]
    j = np.arange(S)[None, :]
    ok = np.ones((S, S), dtype=bool)
    if causal:
        ok &= j <= i
    if window > 0:
        ok &= np.abs(i - j) < window
    if docs:
        doc = np.repeat(np.arange(len(docs)), docs)
        ok &= doc[:, None] == doc[None, :]
    return ok


def attention(q, k, v, dout, ok, scale):
    S, H, D = q.shape
    G = H // k.shape[1]
    kk = np.repeat(k, G, axis=1)  # query head h reads kv head h // G
    vv = np.repeat(v, G, axis=1)
    s = np.einsum("ihd,jhd->hij", q, kk) * scale
    s = np.where(ok[None], s, -np.inf)
    m = s.max(axis=2, keepdims=True)
    seen = np.isfinite(m)
    m = np.where(seen, m, 0.0)
    e = np.exp(s - m)
    l = e.sum(axis=2, keepdims=True)
    p = np.where(seen, e / np.where(l > 0, l, 1.0), 0.0)
    out = np.einsum("hij,jhd->ihd", p, vv)
    lse = np.where(seen[..., 0], (m + np.log(np.where(l > 0, l, 1.0)))[..., 0], -np.inf)
    grads = None
    if dout is not None:
        dv_full = np.einsum("hij,ihd->jhd", p, dout)
        dp = np.einsum("ihd,jhd->hij", dout, vv)
        delta = np.einsum("ihd,ihd->hi", dout, out)[..., None]
        ds = p * (dp - delta)
        dq = np.einsum("hij,jhd->ihd", ds, kk) * scale
        dk_full = np.einsum("hij,ihd->jhd", ds, q) * scale
        hkv = k.shape[1]
        dk = dk_full.reshape(S, hkv, G, D).sum(axis=2)
        dv = dv_full.reshape(S, hkv, G, D).sum(axis=2)
        grads = (dq, dk, dv)
    return out, lse, grads


def rel_err(x, ref):
    finite = np.isfinite(ref)
    if not np.array_equal(np.isfinite(x), finite) or np.any(x[~finite] != ref[~finite]):
        return float("inf")
    num = np.linalg.norm((x - ref)[finite])
    den = np.linalg.norm(ref[finite])
    return num / den if den > 0 else num


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make")
    mk.add_argument("dir")
    mk.add_argument("--seq", type=int, required=True)
    mk.add_argument("--heads", type=int, required=True)
    mk.add_argument("--kv-heads", type=int, required=True)
    mk.add_argument("--head-dim", type=int, required=True)
    mk.add_argument("--seed", type=int, default=0)
    ck = sub.add_parser("check")
    ck.add_argument("input")
    ck.add_argument("output")
    ck.add_argument("--no-causal", action="store_true")
    ck.add_argument("--window", type=int, default=0)
    ck.add_argument("--docs", default="")
    ck.add_argument("--backward", action="store_true")
    ck.add_argument("--tol", type=float, default=1e-5)
    a = ap.parse_args()
    if a.cmd == "make":
        rng = np.random.default_rng(a.seed)
        S, H, HKV, D = a.seq, a.heads, a.kv_heads, a.head_dim
        for name, shape in (("q", (S, H, D)), ("k", (S, HKV, D)), ("v", (S, HKV, D)),
                            ("dout", (S, H, D))):
            np.save(f"{a.dir}/{name}.npy", rng.standard_normal(shape).astype(np.float32))
        return 0
    q = np.load(f"{a.input}/q.npy").astype(np.float64)
    k = np.load(f"{a.input}/k.npy").astype(np.float64)
    v = np.load(f"{a.input}/v.npy").astype(np.float64)
    dout = np.load(f"{a.input}/dout.npy").astype(np.float64) if a.backward else None
    S, H, D = q.shape
    docs = [int(x) for x in a.docs.split(",")] if a.docs else []
    ok = mask_matrix(S, not a.no_causal, a.window, docs)
    out, lse, grads = attention(q, k, v, dout, ok, 1.0 / np.sqrt(D))
    refs = {"out": out, "lse": lse}
    if grads is not None:
        refs.update(dq=grads[0], dk=grads[1], dv=grads[2])
    worst = 0.0
    for name, ref in refs.items():
        got = np.load(f"{a.output}/{name}.npy")
        if got.dtype != np.float32 or got.shape != ref.shape:
            print(f"{name}.npy: dtype {got.dtype} shape {got.shape}, expected float32 {ref.shape}")
            return 1
        e = rel_err(got.astype(np.float64), ref)
        print(f"{name}: relative error {e:.3g}")
        worst = max(worst, e)
    if not worst <= a.tol:
        print(f"FAILED: worst relative error {worst:.3g} > {a.tol:g}")
        return 1
    print(f"passed: worst relative error {worst:.3g} <= {a.tol:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
