"""A small PyTorch transformer whose attention is loom.torch.cp_attention, trained on the King
James Bible (data/kjv.txt, written by scripts/setup.sh), context-parallel over a torch.distributed
group: every rank holds the zigzag shard of each sequence, loom's engine passes K and V between
the ranks, and the gradients of the (replicated) weights are summed over the group.

    /usr/bin/python3 -m loom.torchrun --nproc_per_node 4 examples/torch_cp_train.py

(loom.torchrun is torchrun with a work-around for Debian's Python 3.11; `torchrun` works where
that bug is absent.) After the context-parallel run, rank 0 trains the same model, from the same
initial weights on the same batches, on one process twice: with loom.torch.attention and with
torch's own eager attention (matmul, mask, softmax, matmul), and checks the per-step losses:
within 1e-5 relative of the first and 1e-4 of the second. Exit status 1 when they do not match.
Run without a launcher (plain /usr/bin/python3) it trains on one process only.
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import loom.torch as lt


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/kjv.txt", help="training text (bytes are tokens)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence (any length)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--strategy", default="ring", help="ring, ulysses, hybrid, allgather, ring2d")
    p.add_argument("--ulysses", type=int, default=None, help="hybrid: the ulysses degree")
    p.add_argument("--inner", type=int, default=None, help="ring2d: the ranks of each inner ring")
    p.add_argument("--layout", default="zigzag", help="contiguous, zigzag, stripe")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="skip the one-process references")
    return p.parse_args()


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads, mode, args):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.d, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.d, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.d, bias=False)
        self.wo = nn.Linear(heads * self.d, dim, bias=False)
        self.mode, self.args = mode, args

    def forward(self, x):  # x [B, S_local, C]
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.h, self.d)
        k = self.wk(x).view(b, s, self.hkv, self.d)
        v = self.wv(x).view(b, s, self.hkv, self.d)
        if self.mode == "cp":
            o = lt.cp_attention(q, k, v, strategy=self.args.strategy, layout=self.args.layout,
                                ulysses=self.args.ulysses, inner=self.args.inner, causal=True)
        elif self.mode == "loom":
            o = lt.attention(q, k, v, causal=True)
        else:  # torch eager attention
            g = self.h // self.hkv
            qh = q.transpose(1, 2)
            kh = k.repeat_interleave(g, dim=2).transpose(1, 2)
            vh = v.repeat_interleave(g, dim=2).transpose(1, 2)
            scores = qh @ kh.transpose(-1, -2) / math.sqrt(self.d)
            mask = torch.ones(s, s, dtype=torch.bool).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
            o = (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2)
        return self.wo(o.reshape(b, s, self.h * self.d))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, mode, args):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, kv_heads, mode, args)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, args, mode):
        super().__init__()
        self.tok = nn.Embedding(256, args.dim)
        self.pos = nn.Embedding(args.seq, args.dim)
        self.blocks = nn.ModuleList(
            [Block(args.dim, args.heads, args.kv_heads, mode, args) for _ in range(args.layers)])
        self.ln = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, 256, bias=False)

    def forward(self, tokens, positions):  # [B, S_local] tokens, their GLOBAL positions
        x = self.tok(tokens) + self.pos(positions)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def batches(args):
    """The same batches on every rank and in every run: byte windows at seeded offsets."""
    data = torch.frombuffer(bytearray(open(args.data, "rb").read()), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(args.seed + 1)
    for _ in range(args.steps):
        starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=gen)
        x = torch.stack([data[s:s + args.seq] for s in starts.tolist()])
        y = torch.stack([data[s + 1:s + args.seq + 1] for s in starts.tolist()])
        yield x, y


def train(args, mode):
    """Per-step losses (mean cross entropy over all B * S tokens)."""
    torch.manual_seed(args.seed)
    model = GPT(args, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    cp = mode == "cp"
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.batch, -1).contiguous()
    if cp:
        positions = lt.shard(positions, layout=args.layout)
    losses = []
    for x, y in batches(args):
        if cp:
            x, y = lt.shard(x, layout=args.layout), lt.shard(y, layout=args.layout)
        logits = model(x, positions)
        loss_sum = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="sum")
        loss = loss_sum / (args.batch * args.seq)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        total = loss.detach().clone()
        if cp:
            # Each rank's gradient covers its tokens only: sum over the group (one all_reduce).
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            dist.all_reduce(total)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        opt.step()
        losses.append(total.item())
    return losses


def main():
    args = parse_args()
    if not os.path.exists(args.data):
        sys.exit(f"torch_cp_train: {args.data} not found (scripts/setup.sh writes data/kjv.txt)")
    distributed = "WORLD_SIZE" in os.environ
    rank = 0
    if distributed:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        t0 = time.time()
        cp_losses = train(args, "cp")
        cp_time = time.time() - t0
        if rank == 0:
            print(f"context-parallel: {dist.get_world_size()} ranks, strategy {args.strategy}, "
                  f"layout {args.layout}, S = {args.seq}, B = {args.batch}: {cp_time:.2f} s")
    ok = True
    if rank == 0 and (not args.no_check or not distributed):
        loom_losses = train(args, "loom")
        eager_losses = train(args, "eager")
        print(f"{'step':>4} {'cp_attention':>14} {'attention(1p)':>14} {'eager(1p)':>14} "
              f"{'rel vs 1p':>10} {'rel vs eager':>12}")
        worst_l, worst_e = 0.0, 0.0
        for i in range(args.steps):
            a = cp_losses[i] if distributed else loom_losses[i]
            rl = abs(a - loom_losses[i]) / abs(loom_losses[i])
            re = abs(a - eager_losses[i]) / abs(eager_losses[i])
            worst_l, worst_e = max(worst_l, rl), max(worst_e, re)
            print(f"{i:>4} {a:>14.8f} {loom_losses[i]:>14.8f} {eager_losses[i]:>14.8f} "
                  f"{rl:>10.2e} {re:>12.2e}")
        ok = worst_l <= 1e-5 and worst_e <= 1e-4
        print(f"max relative difference: {worst_l:.2e} vs loom.torch.attention on one process "
              f"(limit 1e-5), {worst_e:.2e} vs torch eager attention (limit 1e-4): "
              f"{'match' if ok else 'MISMATCH'}")
    if distributed:
        flag = torch.tensor([0 if ok else 1])
        dist.broadcast(flag, 0)
        ok = flag.item() == 0
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
