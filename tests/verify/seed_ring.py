#!/usr/bin/python3
"""A small PyTorch context-parallel attention in the style of the first seed's RingAttention
(shared/seeds/000_*.txt): P ranks simulated in one process, each holding one contiguous block of
the sequence; at step j rank i computes attention of its queries against the K/V block of rank
(i - j) mod P and adds it to its output, `output += attn_output_chunk`, exactly like the seed's
loop. That sum is wrong: partial outputs normalised over different key blocks must be weighted
by exp(lse_block - lse) (a log-sum-exp merge), not added. `--fixed` does the merge instead.

Writes DIR/input/{q,k,v}.npy ([1, S, H, D], layout BSHD) and DIR/candidate/out.rank{r}.npy
([1, S/P, H, D], contiguous blocks) for `loom verify --layout-dims BSHD --convention contiguous`.

Usage: /usr/bin/python3 seed_ring.py DIR [--fixed] [--ranks P] [--seq S]
"""
import argparse
import os

import numpy as np
import torch


def block_attention(q, k, v, q_pos, k_pos, causal):
    """Attention of q [B, H, Sq, D] over one K/V block [B, H, Sk, D] with the causal mask on
    global positions (the offset the seed's comment asks for). Returns the block's normalised
    output and its log-sum-exp [B, H, Sq]; rows that see no key give 0 and -inf."""
    scale = q.shape[-1] ** -0.5
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        hidden = k_pos[None, :] > q_pos[:, None]
        s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return torch.matmul(p, v), lse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--fixed", action="store_true", help="merge with log-sum-exp weights")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()
    torch.manual_seed(0)
    B, S, H, D, P = 1, args.seq, 4, 32, args.ranks
    assert S % P == 0, "the seed's loop needs S divisible by the ring size"
    chunk_len = S // P
    x_q = torch.randn(B, S, H, D)
    x_k = torch.randn(B, S, H, D)
    x_v = torch.randn(B, S, H, D)
    os.makedirs(os.path.join(args.dir, "input"), exist_ok=True)
    os.makedirs(os.path.join(args.dir, "candidate"), exist_ok=True)
    for name, t in (("q", x_q), ("k", x_k), ("v", x_v)):
        np.save(os.path.join(args.dir, "input", name + ".npy"), t.numpy())

    # Rank i holds block i of q, k, v, as [B, H, S/P, D] (the seed transposes to heads first).
    blocks = [
        tuple(t[:, r * chunk_len:(r + 1) * chunk_len].transpose(1, 2) for t in (x_q, x_k, x_v))
        for r in range(P)
    ]
    pos = [torch.arange(r * chunk_len, (r + 1) * chunk_len) for r in range(P)]
    for rank in range(P):
        q = blocks[rank][0]
        output = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"))
        for step in range(P):
            src_rank = (rank - step) % P  # the block received at this step
            k_chunk, v_chunk = blocks[src_rank][1], blocks[src_rank][2]
            attn_output_chunk, lse_chunk = block_attention(q, k_chunk, v_chunk, pos[rank],
                                                           pos[src_rank], causal=True)
            if args.fixed:
                new_lse = torch.logaddexp(lse, lse_chunk)
                w_old = torch.exp(lse - new_lse).nan_to_num(0.0)[..., None]
                w_new = torch.exp(lse_chunk - new_lse).nan_to_num(0.0)[..., None]
                output = output * w_old + attn_output_chunk * w_new
                lse = new_lse
            else:
                output += attn_output_chunk  # the seed: "累加部分结果"
        out = output.transpose(1, 2).contiguous()  # [B, S/P, H, D]
        np.save(os.path.join(args.dir, "candidate", "out.rank%d.npy" % rank), out.numpy())


if __name__ == "__main__":
    main()
