"""A small PyTorch transformer whose attention is loom.torch.cp_attention, trained on the King
James Bible (data/kjv.txt, written by scripts/setup.sh), context-parallel over a torch.distributed
group: every rank holds the zigzag shard of each sequence, loom's engine passes K and V between
the ranks, and the gradients of the (replicated) weights are summed over the group.

    /usr/bin/python3 -m loom.torchrun --standalone --nproc_per_node 4 examples/torch_cp_train.py

(loom.torchrun is torchrun with work-arounds for Debian's torch 1.13 on Python 3.11; `torchrun`
works where those bugs are absent.) After the context-parallel run, rank 0 trains the same model,
from the same initial weights on the same batches, on one process twice: with
loom.torch.attention and with torch's own eager attention (matmul, mask, softmax, matmul), and
checks
  - at step 0, before any update: every layer's attention output and every parameter's gradient
    (summed over the ranks), within 1e-5 norm-relative of the one-process loom.torch.attention
    run and of the eager run (a per-step loss hides a wrong gradient: AdamW's steps hardly
    depend on the gradient's scale, and a mean loss averages one rank's error away);
  - every step's loss: within 1e-5 relative of the first run and 1e-4 of the second (eager
    attention rounds differently, and ten steps of training let that grow).
Exit status 1 when they do not match, or when any run's loss is not finite (NaN: the run
diverged, and a NaN matches nothing); 2, with one line, for a bad option. --no-check skips the
reference runs and their checks (not the finite-loss one).
Run without a launcher (plain /usr/bin/python3) it trains on one process with
loom.torch.attention, and checks that run against the eager one the same way (there is no
context-parallel run to check then).
"""
import argparse
import math
import os
import stat
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import loom
import loom.torch as lt


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # argparse's own error printed its whole usage, from every rank under a launcher: one
        # line (rank 0's), exit status 2, as for every other bad value.
        fail(message)


def parse_args():
    p = _Parser(description=__doc__.split("\n\n")[0])
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
    p.add_argument("--no-check", action="store_true",
                   help="skip the reference runs and their checks (under a launcher: the "
                        "one-process runs; without one: the eager run)")
    args = p.parse_args()
    for name in ("steps", "seq", "batch", "dim", "heads", "kv_heads", "layers"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.dim % args.heads:
        fail(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    if args.dim // args.heads > 256:
        # loom's kernels take a head dim of at most 256: without a launcher this was the
        # kernels' InvalidArgument traceback at the first forward.
        fail(f"--dim {args.dim} / --heads {args.heads} is a head dim of {args.dim // args.heads}; "
             f"loom's kernels take at most 256 (raise --heads)")
    if args.heads % args.kv_heads:
        fail(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.strategy not in lt.strategies():
        fail(f"unknown --strategy {args.strategy!r} (choose {', '.join(lt.strategies())})")
    if args.layout not in lt.layouts:
        fail(f"unknown --layout {args.layout!r} (choose {', '.join(lt.layouts)})")
    if not 0 < args.lr < math.inf:
        fail(f"--lr must be a positive number, got {args.lr}")
    return args


def fail(message):
    """One line on stderr (rank 0's only under a launcher: every rank checks the same arguments)
    and exit status 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"torch_cp_train: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads, mode, args):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.d, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.d, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.d, bias=False)
        self.wo = nn.Linear(heads * self.d, dim, bias=False)
        self.mode, self.args = mode, args
        self.record = None  # a list: forward appends its attention output (detached) to it

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
        if self.record is not None:
            self.record.append(o.detach().clone())
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


DATA_LIMIT = 1 << 30  # bytes of --data read, at most (loom train's default --data-limit)


def load_data(args):
    """The training bytes as a 1-D int64 tensor; one clear line (SystemExit) when there are not
    seq + 1 of them (a window is seq input bytes and the seq labels one byte later), or when
    --data is not a regular file of at most DATA_LIMIT bytes (a FIFO blocked in open() for ever,
    and /dev/zero grew without bound)."""
    try:
        st = os.stat(args.data)
        if not stat.S_ISREG(st.st_mode):
            fail(f"cannot read --data {args.data}: not a regular file (a directory, FIFO or "
                 "device; scripts/setup.sh writes data/kjv.txt)")
        if st.st_size > DATA_LIMIT:
            fail(f"--data {args.data} holds {st.st_size} bytes, more than this example reads "
                 f"({DATA_LIMIT})")
        with open(args.data, "rb") as f:
            raw = f.read(DATA_LIMIT + 1)
    except OSError as e:
        fail(f"cannot read --data {args.data}: {e.strerror} (scripts/setup.sh writes data/kjv.txt)")
    if len(raw) > DATA_LIMIT:
        fail(f"--data {args.data} grew past {DATA_LIMIT} bytes while it was read")
    if len(raw) < args.seq + 1:
        fail(f"--seq {args.seq} needs at least {args.seq + 1} bytes of --data; {args.data} has "
             f"{len(raw)}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def batches(args, data):
    """The same batches on every rank and in every run: byte windows at seeded offsets (any start
    from 0 to numel - seq - 1, both included: the labels end at the last byte)."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    for _ in range(args.steps):
        starts = torch.randint(0, data.numel() - args.seq, (args.batch,), generator=gen)
        x = torch.stack([data[s:s + args.seq] for s in starts.tolist()])
        y = torch.stack([data[s + 1:s + args.seq + 1] for s in starts.tolist()])
        yield x, y


def train(args, mode, data):
    """(per-step losses (mean cross entropy over all B * S tokens), step 0's tensors): step 0's
    are, before the first update, every layer's attention output ("attention output of layer i",
    [B, S, H, D], the whole sequence in order: a context-parallel run gathers its shards) and
    every parameter's gradient (summed over the ranks)."""
    torch.manual_seed(args.seed)
    model = GPT(args, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    cp = mode == "cp"
    positions = torch.arange(args.seq).unsqueeze(0).expand(args.batch, -1).contiguous()
    if cp:
        positions = lt.shard(positions, layout=args.layout)
    losses, first = [], {}
    for step, (x, y) in enumerate(batches(args, data)):
        if cp:
            x, y = lt.shard(x, layout=args.layout), lt.shard(y, layout=args.layout)
        for blk in model.blocks:
            blk.attn.record = [] if step == 0 else None
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
        if step == 0:
            for i, blk in enumerate(model.blocks):
                (o,) = blk.attn.record
                first[f"attention output of layer {i}"] = (
                    lt.unshard(o, layout=args.layout) if cp else o)
                blk.attn.record = None
            for name, p in model.named_parameters():
                first[f"gradient of {name}"] = p.grad.detach().clone()
        opt.step()
        losses.append(total.item())
    return losses, first


# Step 0's tensors, two runs: ||a - b|| / ||b|| (fp64 norms over the whole tensor) at most 1e-5.
# Both runs compute one fp32 function of the same weights and bytes, in other summation orders
# only (the engine's blocks and ranks, the sum of the ranks' gradients, eager's matmul and
# softmax). 1e-5 is loom's fp32 tolerance for attention against its fp64 reference (kFp32RelTol
# in tests/unit/tolerance.h, which torch's eager attention meets too), and the layers around
# attention are the same ops on the same rows, so two right runs stay well inside it: they differ
# by 1e-7 to 3e-7 in the attention outputs and at most 8e-7 in any gradient (ring, ulysses,
# hybrid, allgather and ring2d, every layout, 2 to 4 ranks, fp32 rounding being 6e-8). Wrong
# results are far outside it: 1 % noise on one rank's attention output gives 5e-3, 0.1 % 5e-4,
# dk x 1.1 on every rank 1e-1 (on one rank 3e-2), 5 % noise on dq 2e-2, 1 % on dv 3e-3 -- while
# the per-step losses missed all but one of those. The norm of the whole tensor, not each
# element: an entry near zero (a cancellation) differs relatively by far more than its tensor
# without anything being wrong.
STEP0_REL_TOL = 1e-5


def rel_diff(a, b):
    """||a - b|| / ||b||; inf when either holds a NaN or an infinity (a NaN reference with an
    all-zero a was 0.0, a match)."""
    a, b = a.double(), b.double()
    ref = b.norm().item()
    if not (math.isfinite(ref) and math.isfinite(a.norm().item())):
        return math.inf
    return (a - b).norm().item() / ref if ref > 0 else (0.0 if a.norm().item() == 0 else math.inf)


def loss_rel(a, ref):
    """|a - ref| / |ref|; inf when either is not finite (the running max took max(0.0, nan),
    which is 0.0: NaN losses from a diverged run were reported as a match)."""
    if not (math.isfinite(a) and math.isfinite(ref)):
        return math.inf
    return abs(a - ref) / abs(ref) if ref != 0 else (0.0 if a == 0 else math.inf)


def compare_step0(name, got, ref):
    """Prints the worst attention output and the worst gradient of got vs ref; True if every
    tensor is within STEP0_REL_TOL. A tensor that differs is named."""
    ok = True
    for kind in ("attention output", "gradient"):
        keys = [k for k in ref if k.startswith(kind)]
        diffs = {k: rel_diff(got[k], ref[k]) for k in keys}
        worst = max(keys, key=lambda k: diffs[k])
        bad = [k for k in keys if not diffs[k] <= STEP0_REL_TOL]
        label = f"{kind}s" if kind == "gradient" else "attention outputs"
        print(f"step 0, {label} ({len(keys)} tensors) vs {name}: max {diffs[worst]:.2e} "
              f"({worst.split(' of ')[1]}), limit {STEP0_REL_TOL:.0e}: "
              f"{'match' if not bad else 'MISMATCH'}")
        for k in bad:
            print(f"  MISMATCH {k}: {diffs[k]:.2e}")
        ok = ok and not bad
    return ok


def compare_losses(losses, name, references):
    """Prints the per-step losses of `losses` (column `name`) beside each reference run
    ((column, difference column, losses, relative limit)) and their relative differences; True if
    every loss is finite and every step is within every limit (a NaN or infinite loss, in any
    run, is a mismatch, with or without references: the run diverged, and NaN matches NaN)."""
    print(f"{'step':>4} {name:>14}" + "".join(f" {col:>14}" for col, _, _, _ in references)
          + "".join(f" {rel:>12}" for _, rel, _, _ in references))
    worst = [0.0] * len(references)
    for i, a in enumerate(losses):
        rels = [loss_rel(a, ref[i]) for _, _, ref, _ in references]
        worst = [max(w, r) for w, r in zip(worst, rels)]
        print(f"{i:>4} {a:>14.8f}" + "".join(f" {ref[i]:>14.8f}" for _, _, ref, _ in references)
              + "".join(f" {r:>12.2e}" for r in rels))
    runs = [(name, losses)] + [(col, ref) for col, _, ref, _ in references]
    diverged = [(col, i, x) for col, run in runs for i, x in enumerate(run) if not math.isfinite(x)]
    if diverged:
        col, i, x = diverged[0]
        print(f"{col}: the loss at step {i} is {x} (not finite; the run diverged, a smaller --lr "
              f"may help): MISMATCH")
    if not references:
        return not diverged
    ok = not diverged and all(w <= limit for w, (_, _, _, limit) in zip(worst, references))
    print("max relative difference of the losses: "
          + ", ".join(f"{w:.2e} vs {col} (limit {limit:.0e})"
                      for w, (col, _, _, limit) in zip(worst, references))
          + f": {'match' if ok else 'MISMATCH'}")
    return ok


def main():
    args = parse_args()
    data = load_data(args)
    distributed = "WORLD_SIZE" in os.environ
    # The context-parallel options shape the cp run alone: without a launcher there is none, and
    # they were ignored without a word (--ulysses 2 ran the one-process model, exit 0).
    given = [f"--{n}" for n, default in (("strategy", "ring"), ("layout", "zigzag"),
                                         ("ulysses", None), ("inner", None))
             if getattr(args, n) != default]
    if given and not distributed:
        fail(f"{', '.join(given)} shape{'s' if len(given) == 1 else ''} the context-parallel run, "
             "which needs a launcher (/usr/bin/python3 -m loom.torchrun --nproc_per_node N ...); "
             "without one the script runs one process")
    rank, ok = 0, True
    if distributed:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    t0 = time.time()
    if distributed:
        try:
            losses, first = train(args, "cp", data)
        except loom.InvalidArgument as e:
            # An option cp_attention refuses (--strategy, --layout, --ulysses, --inner): every
            # rank raises the same error at once (the ranks check their arguments together).
            fail(str(e))
        if rank == 0:
            print(f"context-parallel: {dist.get_world_size()} ranks, strategy {args.strategy}, "
                  f"layout {args.layout}, S = {args.seq}, B = {args.batch}: "
                  f"{time.time() - t0:.2f} s")
    else:
        losses, first = train(args, "loom", data)
        print(f"one process (no launcher, so no context-parallel run to check): "
              f"loom.torch.attention, S = {args.seq}, B = {args.batch}: {time.time() - t0:.2f} s")
    if rank == 0 and args.no_check:
        print("--no-check: no reference runs")
        ok = compare_losses(losses, "cp_attention" if distributed else "attention(1p)", [])
        if not ok:
            print("MISMATCH: exit status 1")
    elif rank == 0:
        if distributed:
            loom_losses, loom_first = train(args, "loom", data)
            eager_losses, eager_first = train(args, "eager", data)
            ok = compare_step0("loom.torch.attention on one process", first, loom_first)
            ok = compare_step0("torch eager attention on one process", first, eager_first) and ok
            ok = compare_losses(losses, "cp_attention",
                                [("attention(1p)", "rel vs 1p", loom_losses, 1e-5),
                                 ("eager(1p)", "rel vs eager", eager_losses, 1e-4)]) and ok
        else:
            eager_losses, eager_first = train(args, "eager", data)
            ok = compare_step0("torch eager attention on one process", first, eager_first)
            ok = compare_losses(losses, "attention(1p)",
                                [("eager(1p)", "rel vs eager", eager_losses, 1e-4)]) and ok
        print("every check matches" if ok else "MISMATCH: exit status 1")
    if distributed:
        flag = torch.tensor([0 if ok else 1])
        dist.broadcast(flag, 0)
        ok = flag.item() == 0
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
