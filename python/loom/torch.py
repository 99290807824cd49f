"""loom.torch: exact attention, on one process or context-parallel over a torch.distributed group.

    out = loom.torch.attention(q, k, v, causal=True)                  # one rank
    out = loom.torch.cp_attention(q, k, v, group, strategy="ring")    # this rank's shard
    q_shard = loom.torch.shard(q, group, "zigzag")                    # the split cp_attention expects
    out_ref = loom.torch.reference_attention(q, k, v)                 # loom's fp64 reference

Tensors are CPU tensors, fp32 or bf16 (fp32 accumulation, fp32 lse), in one of two layouts:
  bshd  q [B, S, H, D], k and v [B, S, Hkv, D]: each batch row is one sequence;
  thd   q [T, H, D], k and v [T, Hkv, D] with cu_seqlens [N + 1] (int32/int64, starting at 0,
        increasing, ending at the global T): N packed documents, attention within each.
H % Hkv == 0 (GQA/MQA: query head h reads KV head h // (H // Hkv)). The mask is defined on global
token positions: a query sees a key of its own document iff (not causal or key <= query) and
(window is None or |query - key| < window).

Each op is a torch.autograd.Function with an exact backward (the gradient of lse is not
propagated: lse is returned as a non-differentiable output). Every bad input raises one of
loom.errors' exceptions with one line naming the value. docs/python.md has the whole story.
"""
import functools
import math
import numbers

import torch
import torch.distributed as dist

from . import _loom
from .errors import CommError, Error, InvalidArgument, NotSupported, Timeout  # noqa: F401

__all__ = [
    "attention", "cp_attention", "shard", "unshard", "reference_attention", "set_timeout",
    "strategies", "layouts", "verify",
]

layouts = ("contiguous", "zigzag", "stripe")


def strategies():
    """The strategy names loom's registry accepts (ring, ulysses, hybrid, allgather, ...)."""
    names = _loom.strategies()
    return tuple(names) if names else ("ring", "ulysses", "hybrid", "allgather")


# ---------------------------------------------------------------------------------------------
# Argument checks (once, at the entry; the C++ side re-checks only what it must).

def _tensor(x, name):
    if not isinstance(x, torch.Tensor):
        raise InvalidArgument(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise NotSupported(
            f"{name} is on {x.device}: loom.torch runs on CPU tensors only (this build has no "
            f"GPU backend); move the tensors with .cpu()")
    if x.layout != torch.strided:
        raise InvalidArgument(f"{name} has layout {x.layout}; loom.torch takes dense (strided) "
                              f"tensors: call .to_dense()")
    if x.is_neg() or x.is_conj():
        # A lazy negation (or conjugation) view: its bytes hold the values before it, which the
        # kernels read (a wrong answer, once).
        raise InvalidArgument(f"{name} is a lazy {'negation' if x.is_neg() else 'conjugation'} "
                              f"view; call .resolve_neg() / .resolve_conj() first")
    _require_storage(x, name)
    return x


def _require_storage(x, name, where=""):
    """A tensor with no storage of its own is a vmap's batched tensor: its logical shape passes
    every check, and the kernels then met torch's raw "Cannot access data pointer of Tensor that
    doesn't have storage". NotSupported instead, in the forward (q, k, v) and in the backward (a
    vectorized jacobian batches dout only; in cp_attention's every rank's alike, so every rank
    raises it before the backward's exchange)."""
    try:
        x.data_ptr()
    except RuntimeError:
        raise NotSupported(
            f"{where}{name} is a vmap's batched tensor, with no storage for loom's kernels to "
            "read: loom.torch does not support vmap, which torch.autograd.functional.jacobian and "
            "hessian use with vectorize=True and torch.autograd.grad with is_grads_batched=True; "
            "call them with vectorize=False / is_grads_batched=False") from None


def _check_qkv(q, k, v, cu_seqlens, allow_f64=False, allow_empty=False):
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        _tensor(x, name)
    ok = (torch.float32, torch.bfloat16) + ((torch.float64, torch.float16) if allow_f64 else ())
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if x.dtype not in ok:
            raise InvalidArgument(
                f"{name} has dtype {x.dtype}; loom.torch takes "
                + " or ".join(str(t) for t in ok))
    if not allow_f64 and not (q.dtype == k.dtype == v.dtype):
        raise InvalidArgument(
            f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    want = 3 if cu_seqlens is not None else 4
    what = "[T, H, D] with cu_seqlens" if want == 3 else "[B, S, H, D] (or [T, H, D] with cu_seqlens)"
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if x.dim() != want:
            raise InvalidArgument(f"{name} must be {what}, got shape {list(x.shape)}")
        if not allow_f64 and not x.is_contiguous():
            raise InvalidArgument(
                f"{name} is not contiguous (shape {list(x.shape)}, strides {list(x.stride())}); "
                f"call .contiguous()")
    if k.shape != v.shape:
        raise InvalidArgument(f"k and v must have one shape, got {list(k.shape)} and {list(v.shape)}")
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise InvalidArgument(
            f"q {list(q.shape)} and k {list(k.shape)} must agree on every dimension but the heads")
    if q.shape[:-2].numel() == 0 and not allow_empty:
        raise InvalidArgument(f"q holds no tokens (shape {list(q.shape)}); loom.torch needs at "
                              "least one")
    heads, kv_heads, dim = q.shape[-2], k.shape[-2], q.shape[-1]
    if heads < 1 or kv_heads < 1 or heads % kv_heads != 0:
        raise InvalidArgument(
            f"the query heads ({heads}) must be a positive multiple of the kv heads ({kv_heads})")
    if dim < 1 or dim > 256:
        raise InvalidArgument(f"head_dim must be in [1, 256], got {dim}")
    return heads, kv_heads, dim


def _finite(x):
    """math.isfinite, false for an int too large for a float (isfinite raised OverflowError)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


_MIN_SCALE = 1.1754943508222875e-38  # fp32's smallest normal: a subnormal scale erred 40 % in dq
_MAX_SCALE = 3.4028234663852886e38 / 1.4426950408889634  # times log2(e) stays finite


def _f32_text(x):
    """The fewest digits that read back as float32 x: with .6g the largest scale the kernels take,
    2.3586574e+38, read 2.35866e+38, which is above it (that number, passed back, was refused)."""
    for digits in range(1, 10):
        text = f"{x:.{digits}g}"
        if torch.tensor(float(text), dtype=torch.float32).item() == x:
            return text
    return repr(x)


def _largest_f32_at_most(x):
    f = torch.tensor(x, dtype=torch.float32)
    if f.item() > x:
        f = torch.nextafter(f, torch.tensor(0.0))
    return f.item()


# The range as the kernels' own messages print it: 1.1754944e-38 .. 2.3586574e+38.
_SCALE_RANGE = f"{_f32_text(_MIN_SCALE)} .. {_f32_text(_largest_f32_at_most(_MAX_SCALE))}"


def _check_mask(causal, window, scale, dim):
    if type(causal).__name__ == "bool_":  # numpy's bool (np.bool_(True) was "got True")
        causal = bool(causal)
    if not isinstance(causal, bool):
        raise InvalidArgument(f"causal must be True or False, got {causal!r}")
    if window is None:
        w = 0
    elif isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1:
        raise InvalidArgument(f"window must be None or a positive int, got {window!r}")
    else:
        # A window past int64 sees every key, as 2^63 - 1 does (positions are int64): the same
        # mask, in the engine's int64 (a larger int was a pybind TypeError).
        w = min(int(window), 2**63 - 1)
    if scale is None:
        s = 1.0 / math.sqrt(dim)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not (
            _finite(scale) and scale > 0):
        raise InvalidArgument(f"scale must be None or a positive finite number, got {scale!r}")
    else:
        s = float(scale)
        # The kernels take the scale in fp32, times log2(e): a value that rounds to 0 there or
        # overflows was reported as "got 0" or "got inf", a number the caller never passed.
        s32 = torch.tensor(s, dtype=torch.float32).item()
        if not _MIN_SCALE <= s32 <= _MAX_SCALE:
            raise InvalidArgument(f"scale must be within fp32's range for the kernels "
                                  f"({_SCALE_RANGE}), got {scale!r}")
    return causal, w, s


def _doc_lengths(cu_seqlens, total=None, what="T"):
    """cu_seqlens -> list of document lengths (checked)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.device.type != "cpu":
            raise NotSupported(f"cu_seqlens is on {cu_seqlens.device}; loom.torch takes CPU tensors")
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
            raise InvalidArgument(
                f"cu_seqlens must be a 1-d int32 or int64 tensor, got {cu_seqlens.dtype} of shape "
                f"{list(cu_seqlens.shape)}")
        cu = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, (list, tuple)) and all(
            isinstance(c, numbers.Integral) and not isinstance(c, bool) for c in cu_seqlens):
        cu = [int(c) for c in cu_seqlens]
    else:
        raise InvalidArgument(
            f"cu_seqlens must be a 1-d int tensor or a list of ints, got {type(cu_seqlens).__name__}")
    if len(cu) < 2 or cu[0] != 0:
        raise InvalidArgument(f"cu_seqlens must start at 0 and have at least 2 entries, got {cu[:8]}")
    # Past int64 the engine cannot take it: cp_attention's call raised a TypeError before its
    # exchange, and the other ranks' calls paired with this rank's next one (wrong answers).
    if cu[-1] > 2**63 - 1:
        raise InvalidArgument(f"cu_seqlens ends at {cu[-1]}, past 2^63 - 1 tokens")
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    for i, l in enumerate(lengths):
        if l <= 0:
            raise InvalidArgument(
                f"cu_seqlens must increase strictly: document {i} has length {l} "
                f"(cu_seqlens[{i}] = {cu[i]}, cu_seqlens[{i + 1}] = {cu[i + 1]})")
    if total is not None and cu[-1] != total:
        raise InvalidArgument(f"cu_seqlens ends at {cu[-1]} but the tensors hold {what} = {total} tokens")
    return lengths


# ---------------------------------------------------------------------------------------------
# Groups.

_groups = {}  # id(ProcessGroup) -> (ProcessGroup, _loom.Group, registered in torch's group map)

# Collective calls (cp_attention, unshard) that raised on this rank because `group` was not a
# process group ("world", a list of ranks): such a call never met the other ranks, which may be
# waiting in theirs, and this rank's next call over that group paired with their pending one (both
# returned another call's result, shifted for every call after, without an error). Where this
# process belongs to one group of more than one rank, the call was meant for it: this rank's next
# cp_attention or unshard over it first makes the lost call's exchange, marked refused (the
# others' pending call raises "rank r could not take its arguments"), then its own, in step.
# _owed: id(ProcessGroup) -> (ProcessGroup, [the lost calls' kinds]). Where it belongs to several,
# loom cannot tell which one's ranks wait, and no guess is safe (a wrong one shifts the calls of
# another group): every later cp_attention or unshard of this process over a group of more than
# one rank raises at once, without meeting the others (who end in loom.Timeout). _stuck: the
# first such call, described.
_owed = {}
_stuck = None


def _known_groups():
    """Every process group of more than one rank this process knows: torch.distributed's and the
    ones loom holds (but those torch.distributed has destroyed)."""
    live = dist.distributed_c10d._pg_map if dist.is_available() and dist.is_initialized() else {}
    known = {id(pg): pg for pg, _, registered in _groups.values() if not registered or pg in live}
    known.update((id(pg), pg) for pg in live)
    return [pg for pg in known.values() if pg.size() > 1]


def _short_repr(x):
    try:
        text = repr(x)
    except Exception:  # noqa: BLE001 (any object may be passed)
        text = f"<{type(x).__name__}>"
    return text if len(text) <= 40 else text[:37] + "..."


def _process_group(group, who, collective=False):
    """The ProcessGroup that `group` names (None: the default group), checked. `collective`: the
    call meets the other ranks (cp_attention, unshard), so one that raises here for a `group`
    that is not a process group leaves an exchange owed (_owed) or the process stuck (_stuck)."""
    global _stuck
    if group is None:
        if not dist.is_available() or not dist.is_initialized():
            launcher = _loom.launcher_backend()  # loom's one launcher check: mpi, torch, local
            hint = ("this process was started by torchrun: call "
                    "torch.distributed.init_process_group('gloo') first" if launcher == "torch"
                    else "call torch.distributed.init_process_group first (under torchrun), "
                    "or pass group=")
            raise InvalidArgument(f"{who} needs a process group: {hint}")
        group = dist.distributed_c10d._get_default_group()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise InvalidArgument(f"{who}: this rank is not a member of the group (torch.distributed "
                              "gives ranks outside a new_group NON_GROUP_MEMBER)")
    if not isinstance(group, dist.ProcessGroup):
        text = f"group must be a torch.distributed ProcessGroup, got {type(group).__name__}"
        known = _known_groups() if collective else []
        if len(known) == 1:
            entry = _owed.get(id(known[0]))
            if entry is None or entry[0] is not known[0]:
                entry = _owed[id(known[0])] = (known[0], [])
            entry[1].append(who)
            text += (f"; the other ranks of this process's group may be waiting in their {who}: "
                     "this rank's next cp_attention or unshard over it makes this call's exchange "
                     "first, marked refused, so that their call raises and the calls pair up "
                     "again")
        elif known:
            _stuck = _stuck or f"{who} call with group={_short_repr(group)}"
            text += (f"; this process belongs to {len(known)} groups, and loom cannot tell which "
                     f"one's other ranks wait in their {who}: every later cp_attention or unshard "
                     "of this process over a group of more than one rank raises (they end in "
                     "loom.Timeout); end the process")
        raise InvalidArgument(text)
    return group


def _loom_group(group, timeout_s=-1.0):
    """loom's Group over the ProcessGroup `group`, made on first use with the timeout timeout_s
    (-1: LOOM_TIMEOUT_S or 60 s)."""
    entry = _groups.get(id(group))
    if entry is None or entry[0] is not group:
        # Forget groups that torch.distributed has destroyed since: each entry holds its group,
        # its sockets and its ops' buffers (30 new_group / destroy_process_group rounds kept 60
        # file descriptors open). A group torch never registered is kept as long as the process.
        live = dist.distributed_c10d._pg_map
        for key, (pg, _, registered) in list(_groups.items()):
            if registered and pg not in live:
                del _groups[key]
        for key, (pg, _) in list(_owed.items()):
            if pg not in live and id(pg) not in _groups:
                del _owed[key]  # a group destroyed before this rank's next call over it
        entry = (group, _loom.Group(group, timeout_s), group in live)
        _groups[id(group)] = entry
    return entry[1]


def _group(group, who="cp_attention"):
    return _loom_group(_process_group(group, who))


def _settle(group, g, who):
    """Before a collective call over `group`: the exchanges this rank owes it (_owed), or an error
    if the process is out of step for good (_stuck)."""
    if g.size < 2:
        return
    if _stuck is not None:
        raise InvalidArgument(
            f"{who}: this process's earlier {_stuck}, not a process group, never met the other "
            "ranks, and loom cannot tell which of its groups' ranks wait for it: its calls are "
            "out of step with them for good, so no call over a group of more than one rank is "
            "made (the others end in loom.Timeout); end the process")
    entry = _owed.pop(id(group), None)
    if entry is None or entry[0] is not group:
        return
    for kind in entry[1]:
        try:
            with _Naming(f"{who} (making the exchange of this rank's earlier {kind} call, which "
                         "had no process group)"):
                if kind == "cp_attention":
                    g.begin_forward()  # counted, as the others counted theirs
                    g.refuse_forward()
                else:
                    g.unshard_exchange([0, -1])
        except CommError:
            raise
        except InvalidArgument:
            pass  # the others were in another kind of call: they raised as well, in step now


def _long_number_text(x):
    """x as given, shortened past a few dozen characters: 10**400 reads 100000000000... (401
    digits)."""
    if isinstance(x, numbers.Integral):
        digits = str(abs(int(x)))
        sign = "-" if x < 0 else ""
        return sign + (digits if len(digits) <= 24 else f"{digits[:12]}... ({len(digits)} digits)")
    text = repr(x)
    return text if len(text) <= 40 else f"{text[:24]}... ({len(text)} characters)"


def set_timeout(seconds, group=None):
    """Sets loom's timeout (seconds) for every wait over `group` (default: LOOM_TIMEOUT_S or 60):
    a number from 0.001 to 1e9, as LOOM_TIMEOUT_S takes; InvalidArgument for anything else (a
    bool, NaN, inf, 0, a negative number, a non-number). It works whatever LOOM_TIMEOUT_S holds:
    a group given its timeout here does not read the variable."""
    # The range is the communicators' (0.001 to 1e9 s, as LOOM_TIMEOUT_S), checked before the
    # group is looked for; a bool or a non-number is refused here (float() would take True, "3").
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise InvalidArgument(f"timeout must be a number of seconds, got {seconds!r}")
    try:
        seconds = float(seconds)
    except OverflowError:  # an int (or Fraction) past float's range, either sign
        # Named as given: read as +-inf it was reported as "got inf", a value never passed.
        raise InvalidArgument(f"timeout must be from 0.001 to 1e9 seconds, got "
                              f"{_long_number_text(seconds)}, beyond float's range") from None
    _loom.checked_timeout_s(seconds)
    pg = _process_group(group, "set_timeout")
    # A group met here first is made with this timeout, without reading LOOM_TIMEOUT_S: a value
    # loom refuses there ("abc") made a valid set_timeout(2.5) raise the variable's message.
    g = _loom_group(pg, seconds)
    g.timeout_s = seconds


class _Naming:
    """`with _Naming(what):` around a collective call of the op `what`: a CommError or Timeout
    raised there names the op. The engine's text names this rank, the message and the peer
    (`rank 0: all_gather: send to rank 1 timed out after 2.9998 s (the torch group of 2 ranks), the
    rest of the collective's limit of 3 s`), the same in a forward and a backward, and not the
    setting that bounds the wait; it is kept whole, after `what: `, and a Timeout adds the setting
    after it. The same exception (class, traceback)
    goes on. A with block, not a wrapper function: a wrapper's frame would come between the caller
    and Group.op's warning (stacklevel=2 names the caller's line)."""

    def __init__(self, what):
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if isinstance(e, CommError):
            text = f"{self.what}: {e}"
            if isinstance(e, Timeout):
                text += "; loom's timeout is LOOM_TIMEOUT_S or loom.torch.set_timeout"
            e.args = (text,)
        return False  # raised on


# ---------------------------------------------------------------------------------------------
# Layout helpers shared by the ops.

def _rows(q, cu_seqlens):
    """(batch, per-row length, rows) of the packed sequence: bshd -> (B, S, B*S); thd -> (0, T, T)."""
    if cu_seqlens is None:
        return q.shape[0], q.shape[1], q.shape[0] * q.shape[1]
    return 0, q.shape[0], q.shape[0]


def _lse_out(lse, batch, seq):
    """[H, rows] -> [B, H, S] (bshd) or [H, T] (thd)."""
    if batch == 0:
        return lse
    return lse.view(lse.shape[0], batch, seq).permute(1, 0, 2).contiguous()


def _lse_in(lse, batch):
    if batch == 0:
        return lse
    return lse.permute(1, 0, 2).contiguous().view(lse.shape[1], -1)


# The autograd Functions' shared ends: what forward saves and returns, what backward reads and
# returns.

def _save_forward(ctx, q, k, v, out, lse, batch, seq):
    """out (the engine makes it in q's shape: not a view, so that the caller may modify it in
    place); q, k, v, out and the engine's lse [H, rows] saved for backward; and lse as the caller
    sees it (_lse_out, never the saved tensor itself), marked non-differentiable."""
    assert out.shape == q.shape and out._base is None
    ctx.save_for_backward(q, k, v, out, lse)
    lse_out = _lse_out(lse, batch, seq)
    if lse_out.data_ptr() == lse.data_ptr():  # thd, or B = 1: a copy, [H, rows] floats
        lse_out = lse_out.clone()
    ctx.mark_non_differentiable(lse_out)
    return out, lse_out


def _saved(ctx, dout, who):
    """(q, k, v, out, lse, dout): the saved tensors and dout contiguous in q's dtype (`who`: the
    op, for the message on a batched dout)."""
    q, k, v, out, lse = ctx.saved_tensors
    _require_storage(dout, "dout", f"the backward of {who}: ")
    return q, k, v, out, lse, dout.resolve_neg().to(q.dtype).contiguous()


def _input_grads(q, k, v, grads):
    """The engine's fp32 (dq, dk, dv) in the dtype and shape of q, k and v."""
    dq, dk, dv = grads
    return (dq.to(q.dtype).view(q.shape), dk.to(k.dtype).view(k.shape),
            dv.to(v.dtype).view(v.shape))


class _SecondDerivative(torch.autograd.Function):
    """The gradients that a backward made under create_graph=True, handed on with a graph whose
    inputs are the op's real inputs (q, k, v as saved, and dout): differentiating them again
    reaches this backward, which raises. torch's once_differentiable (and loom's wrapper before)
    hung the raising node on fresh detached leaves instead, which no autograd.grad(..., inputs)
    can reach: torch.autograd.functional.jvp, hvp and hessian, gradgradcheck and a gradient
    penalty's autograd.grad pruned it, and returned zeros or a partial result without an error."""

    @staticmethod
    def forward(ctx, who, grads, *inputs):
        ctx.who = who
        # Tensors made under no_grad, never the inputs; detached, so that a view (dq.view(q.shape))
        # is not handed to autograd as a view made inside a custom Function (no copy).
        return tuple(g.detach() for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise NotSupported(
            f"{ctx.who} is once differentiable: a second derivative through it (differentiating a "
            "gradient made with create_graph=True: a gradient penalty, torch.autograd.functional."
            "jvp, hvp or hessian, gradgradcheck) is not supported, and loom.torch raises rather "
            "than leave that term out")


def _once_differentiable(who):
    """The backward of the op `who`, computed without a graph. Under create_graph=True (grad mode
    on in the backward) its gradients come back through _SecondDerivative, connected to q, k, v
    (saved first by every op) and dout: any second derivative through the op raises NotSupported
    naming it, whichever route asks for it, and a create_graph backward that never differentiates
    these gradients again (or whose second derivative does not pass through the op) is
    unaffected. Plain backward (grad mode off) returns them as they are."""
    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *args):
            with torch.no_grad():
                grads = backward(ctx, *args)
            if not torch.is_grad_enabled():
                return grads
            inputs = [x for x in tuple(ctx.saved_tensors[:3]) + args
                      if isinstance(x, torch.Tensor) and x.requires_grad]
            made = [g for g in grads if isinstance(g, torch.Tensor)]
            marked = iter(_SecondDerivative.apply(who, made, *inputs))
            return tuple(next(marked) if isinstance(g, torch.Tensor) else g for g in grads)
        return wrapper
    return decorate


# ---------------------------------------------------------------------------------------------
# One rank.

class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, meta):
        batch, seq, docs, heads, kv_heads, dim, causal, window, scale = meta
        is_bf16 = q.dtype == torch.bfloat16
        ctx.check = torch.is_anomaly_enabled()
        out, lse = _loom.attention_forward(q, k, v, batch, seq, docs, heads, kv_heads, dim,
                                           causal, window, scale, is_bf16, ctx.check)
        ctx.meta = meta
        return _save_forward(ctx, q, k, v, out, lse, batch, seq)

    @staticmethod
    @_once_differentiable("the backward of attention")
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, dout = _saved(ctx, dout, "attention")
        batch, seq, docs, heads, kv_heads, dim, causal, window, scale = ctx.meta
        is_bf16 = q.dtype == torch.bfloat16
        grads = _loom.attention_backward(q, k, v, out, dout, lse, batch, seq, docs, heads,
                                         kv_heads, dim, causal, window, scale, is_bf16,
                                         ctx.check)
        return _input_grads(q, k, v, grads) + (None,)


def attention(q, k, v, causal=True, window=None, cu_seqlens=None, scale=None, return_lse=False):
    """Exact attention on this process. q [B,S,H,D] or [T,H,D] with cu_seqlens; k, v with Hkv
    heads. Returns out (q's shape and dtype), and with return_lse=True also lse (fp32, [B,H,S] or
    [H,T]). scale defaults to 1/sqrt(D). A NaN or Inf in q, k or v gives NaN where the formula
    does, as PyTorch's attention; under torch.autograd.detect_anomaly it raises InvalidArgument
    naming the first one."""
    heads, kv_heads, dim = _check_qkv(q, k, v, cu_seqlens)
    causal, window, scale = _check_mask(causal, window, scale, dim)
    batch, seq, _ = _rows(q, cu_seqlens)
    docs = _doc_lengths(cu_seqlens, seq) if cu_seqlens is not None else []
    meta = (batch, seq, docs, heads, kv_heads, dim, causal, window, scale)
    out, lse = _Attention.apply(q, k, v, meta)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Context parallel.

class _CpAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, op, batch, seq, check, call):
        out, lse = _loom.cp_forward(op, q, k, v)
        ctx.op = op
        ctx.check = check  # agreed by every rank in Group.op
        ctx.call = call  # this forward's number on the group, the same on every rank
        ctx.batch = batch
        return _save_forward(ctx, q, k, v, out, lse, batch, seq)

    @staticmethod
    @_once_differentiable("the backward of cp_attention")
    def backward(ctx, dout, _dlse):
        # cp_backward first checks that every rank is in the backward of this same call (one
        # small all-gather): a rank that skipped a backward, ran an extra one or is in another
        # call gives every rank one clear error, not a Timeout or mixed-up gradients.
        q, k, v, out, lse, dout = _saved(ctx, dout, "cp_attention")
        with _Naming("the backward of cp_attention"):
            grads = _loom.cp_backward(ctx.op, q, k, v, out, dout, lse, ctx.check, ctx.call)
        return _input_grads(q, k, v, grads) + (None, None, None, None, None)


def _degree(name, value, takes, strategy, what):
    """The degree option `name` (ulysses=, inner=), which only strategy `takes` uses and needs."""
    if value is None:
        if strategy == takes:
            raise InvalidArgument(f"strategy={takes!r} needs {name}=N ({what})")
        return 1 if name == "ulysses" else 0
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidArgument(f"{name} must be None or a positive int, got {value!r}")
    if value > 2**31 - 1:  # no group has that many ranks (it was a pybind TypeError)
        raise InvalidArgument(f"{name}={value!r} is larger than any process group")
    if strategy != takes:
        raise InvalidArgument(f"{name}= is only for strategy={takes!r} (got strategy={strategy!r})")
    return int(value)


def cp_attention(q, k, v, group=None, strategy="ring", layout="zigzag", ulysses=None, causal=True,
                 window=None, cu_seqlens=None, scale=None, return_lse=False, inner=None):
    """Context-parallel exact attention over the ranks of `group` (a torch.distributed
    ProcessGroup; None: the default group). q, k, v are this rank's shard (loom.torch.shard with
    the same layout and cu_seqlens). strategy: ring, ulysses, hybrid (needs ulysses=U, the
    ulysses degree), ring2d (needs inner=I, the ranks of each inner ring; the outer ring is
    the group size / I), allgather (loom.torch.strategies()). layout: contiguous, zigzag, stripe.
    cu_seqlens describes the GLOBAL packed sequence (the same on every rank). Returns this
    rank's out (and lse: [B,H,S_local] or [H,T_local]). Collective: every rank of the group
    calls it with the same arguments but its own shard, and in the same anomaly-detection mode
    (non-finite inputs: as attention()); so is its backward: every rank runs the backward of
    the same call, in the same order (a rank that skips one or runs an extra one gets
    InvalidArgument on every rank, naming both ranks' calls)."""
    pg = _process_group(group, "cp_attention", collective=True)
    g = _loom_group(pg)
    _settle(pg, g, "cp_attention")
    g.begin_forward()  # counted on this rank, made or not: ranks out of step are found (_loom.cc)
    try:
        # A rank's shard may hold no tokens (a sequence shorter than 2P, short documents): the
        # ranks' exchange refuses an empty global sequence.
        heads, kv_heads, dim = _check_qkv(q, k, v, cu_seqlens, allow_empty=True)
        causal, window, scale = _check_mask(causal, window, scale, dim)
        if not isinstance(strategy, str):
            raise InvalidArgument(f"strategy must be a string, got {strategy!r}")
        if not isinstance(layout, str) or layout not in layouts:
            raise InvalidArgument(f"unknown layout {layout!r} (choose contiguous, zigzag or stripe)")
        u = _degree("ulysses", ulysses, "hybrid", strategy,
                    "the ulysses degree inside each group; the ring degree is the group size / U")
        i = _degree("inner", inner, "ring2d", strategy,
                    "the ranks of each inner ring; the outer ring is the group size / I")
        batch, seq, rows = _rows(q, cu_seqlens)
        docs = _doc_lengths(cu_seqlens) if cu_seqlens is not None else []
    except Exception:  # noqa: BLE001 (re-raised)
        # Still make the forward's exchange, marked refused, so that every other rank raises at
        # once (naming this rank) instead of waiting for it until the timeout.
        with _Naming("cp_attention (the forward)"):
            g.refuse_forward()
        raise
    check = torch.is_anomaly_enabled()
    with _Naming("cp_attention (the forward)"):
        op = g.op(strategy, layout, u, i, causal, window, scale, batch, rows, heads, kv_heads, dim,
                  q.dtype == torch.bfloat16, docs, q, k, v, check)
        out, lse = _CpAttention.apply(q, k, v, op, batch, seq, check, g.forward_calls)
    return (out, lse) if return_lse else out


def _shard_args(x, group, layout, cu_seqlens, dim, name, who):
    _tensor(x, name)
    if not isinstance(layout, str) or layout not in layouts:
        raise InvalidArgument(f"unknown layout {layout!r} (choose contiguous, zigzag or stripe)")
    g = _group(group, who)
    if dim is None:
        dim = 0 if cu_seqlens is not None else 1
    if not isinstance(dim, numbers.Integral) or not -x.dim() <= dim < x.dim():
        raise InvalidArgument(f"dim {dim!r} is outside a tensor of shape {list(x.shape)}")
    return g, int(dim) % x.dim()


def shard(x, group=None, layout="zigzag", cu_seqlens=None, dim=None):
    """This rank's part of the global tensor x, split along `dim` (default: 1 for [B, S, ...], 0
    for [T, ...] with cu_seqlens) the way cp_attention expects. Returns a new contiguous tensor."""
    g, dim = _shard_args(x, group, layout, cu_seqlens, dim, "x", "shard")
    length = x.shape[dim]
    if length < 1:
        raise InvalidArgument(f"shard: x has no tokens along dim {dim} (shape {list(x.shape)})")
    if cu_seqlens is not None:
        docs = _doc_lengths(cu_seqlens, length, what=f"x.shape[{dim}]")
        idx = _loom.shard_index(layout, g.size, g.rank, 0, length, docs)
    else:
        idx = _loom.shard_index(layout, g.size, g.rank, 1, length, [])
    return x.index_select(dim, idx).contiguous()


_UNSHARD_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
                   torch.complex128)
_UNSHARD_MAX_DIMS = 16


def unshard(x, group=None, layout="zigzag", cu_seqlens=None, dim=None):
    """The inverse of shard: gathers every rank's part (collective over group) and returns the
    global tensor on every rank. Not differentiable (use it for outputs and checks). The ranks
    must pass parts of one dtype and one shape but along `dim`, with the same layout and
    cu_seqlens: a rank that differs gets InvalidArgument on every rank; a rank that never calls
    it, loom.Timeout (set_timeout)."""
    pg = _process_group(group, "unshard", collective=True)
    g = _loom_group(pg)
    _settle(pg, g, "unshard")
    try:
        g, dim = _shard_args(x, group, layout, cu_seqlens, dim, "x", "unshard")
        if x.dim() > _UNSHARD_MAX_DIMS:
            raise InvalidArgument(f"unshard takes at most {_UNSHARD_MAX_DIMS} dims, got {x.dim()}")
        if cu_seqlens is not None:
            docs = _doc_lengths(cu_seqlens, None, what="the ranks' parts together")
            docs_key = hash(tuple(docs))
        else:
            docs, docs_key = [], -1
        dtype_key = _UNSHARD_DTYPES.index(x.dtype) if x.dtype in _UNSHARD_DTYPES else -1
        if dtype_key < 0:
            raise InvalidArgument(f"unshard: x has dtype {x.dtype}, which it does not gather")
    except Error:
        # The exchange still, marked refused (a number of dims of -1): every other rank raises at
        # once instead of waiting for this one until the timeout.
        with _Naming("unshard"):
            g.unshard_exchange([0, -1])
        raise
    shape = list(x.shape)
    shape[dim] = 0
    mine = [x.shape[dim], x.dim(), dim, dtype_key, layouts.index(layout), docs_key] + shape
    # Every rank's description through loom (its timeout; an exchange of one size for every
    # loom.torch collective): a part of another dtype or shape was read as bytes of this one
    # (a wrong tensor, or gloo aborting the process).
    with _Naming("unshard"):
        fields = g.unshard_exchange(mine)
    stride = len(fields) // g.size
    what = ("number of dims", "dim", "dtype", "layout", "cu_seqlens")
    for r in range(g.size):
        if fields[r * stride + 1] == -1:
            raise InvalidArgument(f"unshard: rank {r} could not take its arguments (its own error "
                                  f"says why); every rank of the group raises with it")
    for r in range(g.size):
        theirs = fields[r * stride: r * stride + len(mine)]
        for i, name in enumerate(what, start=1):
            if theirs[i] != mine[i]:
                raise InvalidArgument(f"unshard: rank {r} and rank {g.rank} disagree on the {name}")
        if theirs[len(what) + 1:] != mine[len(what) + 1:]:
            their_shape = theirs[len(what) + 1:]
            their_shape[dim] = theirs[0]
            raise InvalidArgument(f"unshard: rank {r}'s part has shape {their_shape}, rank "
                                  f"{g.rank}'s {list(x.shape)}: they must agree but along dim {dim}")
    sizes = [fields[r * stride] for r in range(g.size)]
    total = sum(sizes)
    if cu_seqlens is not None:
        docs = _doc_lengths(cu_seqlens, total, what="the ranks' parts together")
        batch = 0
    else:
        batch = 1
    idxs = [_loom.shard_index(layout, g.size, r, batch, total, docs) for r in range(g.size)]
    for r in range(g.size):
        if idxs[r].numel() != sizes[r]:
            raise InvalidArgument(
                f"unshard: rank {r} holds {sizes[r]} rows but layout {layout!r} of {total} tokens "
                f"over {g.size} ranks gives it {idxs[r].numel()}")
    width = max(sizes)
    xt = x.detach().movedim(dim, 0).contiguous()
    if math.prod(xt.shape[1:]) == 0:  # rows of no elements (a 0 in another dim): no bytes
        return torch.empty((total,) + tuple(xt.shape[1:]), dtype=x.dtype).movedim(0, dim).contiguous()
    padded = torch.zeros((width,) + tuple(xt.shape[1:]), dtype=x.dtype)
    padded[: xt.shape[0]] = xt
    if padded.dim() == 1:
        padded = padded.view(-1, 1)
    raw = padded.view(torch.uint8).reshape(-1)  # bytes: gloo has no bf16 (nor int16, bool)
    with _Naming("unshard"):
        parts = g.all_gather_bytes(raw)
    out = torch.empty((total,) + tuple(xt.shape[1:]), dtype=x.dtype)
    for r in range(g.size):
        part = parts[r].view(x.dtype).view((width,) + tuple(xt.shape[1:]))
        out.index_copy_(0, idxs[r], part[: sizes[r]])
    return out.movedim(0, dim).contiguous()


# ---------------------------------------------------------------------------------------------
# loom's fp64 reference.

class _Reference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, meta):
        batch, seq, docs, heads, kv_heads, dim, causal, window, scale = meta
        out, lse = _loom.reference_forward(q, k, v, batch, seq, docs, heads, kv_heads, dim,
                                           causal, window, scale)
        ctx.meta = meta
        ctx.save_for_backward(q, k, v)
        lse_out = _lse_out(lse, batch, seq)
        ctx.mark_non_differentiable(lse_out)
        return out, lse_out  # made like q: not a view

    @staticmethod
    @_once_differentiable("the backward of reference_attention")
    def backward(ctx, dout, _dlse):
        q, k, v = ctx.saved_tensors
        _require_storage(dout, "dout", "the backward of reference_attention: ")
        batch, seq, docs, heads, kv_heads, dim, causal, window, scale = ctx.meta
        dq, dk, dv = _loom.reference_backward(q, k, v, dout.double().contiguous(), batch, seq,
                                              docs, heads, kv_heads, dim, causal, window, scale)
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), None


def reference_attention(q, k, v, causal=True, window=None, cu_seqlens=None, scale=None,
                        return_lse=False):
    """loom's fp64 reference (plain loops; slow, exact): the same arguments as attention(); the
    inputs (any float dtype) are widened to fp64 exactly and the result is fp64. Differentiable
    (the fp64 reference backward), so it checks gradients too."""
    heads, kv_heads, dim = _check_qkv(q, k, v, cu_seqlens, allow_f64=True)
    causal, window, scale = _check_mask(causal, window, scale, dim)
    batch, seq, _ = _rows(q, cu_seqlens)
    docs = _doc_lengths(cu_seqlens, seq) if cu_seqlens is not None else []
    meta = (batch, seq, docs, heads, kv_heads, dim, causal, window, scale)
    q64, k64, v64 = (x.double().contiguous() for x in (q, k, v))
    out, lse = _Reference.apply(q64, k64, v64, meta)
    return (out, lse) if return_lse else out


def verify(out, q, k, v, dout=None, lse=None, dq=None, dk=None, dv=None, causal=True,
           window=None, cu_seqlens=None, scale=None, layout="contiguous", ranks=1, dtype=None,
           full_check_max=4096):
    """Checks another implementation's results against loom's fp64 reference, like `loom verify`
    (docs/verify.md), and returns the same report as a dict: "passed", per-tensor errors
    ("tensors"), "absent" tensors and, when something is wrong, "diagnoses" (best first, each
    with "kind" and "text"), and the heat map.

    Every tensor is GLOBAL, in token order: q, out, dout, dq [S, H, D] (or [1, S, H, D]), k, v,
    dk, dv [S, Hkv, D], lse [H, S] or [1, H, S] (loom.torch.unshard first if you hold shards). Any of out, lse,
    dq, dk, dv may be None (not checked); dq, dk, dv need dout. layout and ranks name the
    candidate's sharding (contiguous, zigzag, stripe, rfa-zigzag, te-thd, torch-headtail,
    megatron), so the diagnosis can speak of ranks, chunks and ring steps. dtype: "fp32" or
    "bf16" (the tolerances); default "bf16" where any of out, dq, dk, dv is bfloat16, else
    "fp32" (lse is held to 1e-5 in both). full_check_max: above this many tokens
    out, lse and dq are compared on 256 evenly spaced rows and dk, dv not at all (they need every
    query row), as loom verify's --full-check-max; a sequence of at most 256 tokens is compared
    whole."""
    import json

    def flat(x, name, batched_dims=4, candidate=True):
        if x is None:
            return None
        _tensor(x, name)
        if not x.is_floating_point():
            raise InvalidArgument(f"verify: {name} has dtype {x.dtype}; verify takes floating-point "
                                  "tensors (float32, bfloat16, float16, float64)")
        if candidate and x.dtype == torch.float16:
            # Held to fp32's tolerance, a correct fp16 result (the exact one rounded once: 2e-4)
            # always failed.
            raise InvalidArgument(f"verify: {name} is float16; verify has tolerances for fp32 and "
                                  "bf16 results only, so a float16 result cannot be verified")
        if x.dim() == batched_dims:
            if x.shape[0] != 1:
                shapes = "[H, S] or [1, H, S]" if batched_dims == 3 else "[S, H, D] or [1, S, H, D]"
                raise InvalidArgument(f"verify: {name} has shape {list(x.shape)}; pass one sequence "
                                      f"({shapes}), or cu_seqlens for packed documents")
            x = x[0]
        return x.detach().double().contiguous()

    if dtype is not None and dtype not in ("fp32", "bf16"):
        raise InvalidArgument(f"verify: dtype must be None, 'fp32' or 'bf16', got {dtype!r}")
    if not isinstance(layout, str):
        raise InvalidArgument(f"verify: layout must be a string, got {layout!r}")
    conventions = _loom.verify_conventions()
    if layout not in conventions:
        # Here, not in the engine: its message named loom verify's --convention.
        raise InvalidArgument(f"verify: unknown layout {layout!r} (choose "
                              f"{', '.join(conventions[:-1])} or {conventions[-1]})")
    if isinstance(ranks, bool) or not isinstance(ranks, numbers.Integral) or not 1 <= ranks <= 2**31 - 1:
        raise InvalidArgument(f"verify: ranks must be a positive int (at most 2^31 - 1), got {ranks!r}")
    if (isinstance(full_check_max, bool) or not isinstance(full_check_max, numbers.Integral)
            or not 1 <= full_check_max <= 2**62):
        raise InvalidArgument("verify: full_check_max must be a positive int (at most 2^62), got "
                              f"{full_check_max!r}")
    out64 = flat(out, "out")

    q64, k64, v64 = (flat(x, n, candidate=False) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    heads, kv_heads, dim = _check_qkv(q64, k64, v64, cu_seqlens if cu_seqlens is not None else
                                      [0, q64.shape[0]], allow_f64=True)
    causal, window, scale = _check_mask(causal, window, scale, dim)
    docs = _doc_lengths(cu_seqlens, q64.shape[0]) if cu_seqlens is not None else []
    if ranks > q64.shape[0]:  # as loom verify (a large value ran out of memory)
        raise InvalidArgument(f"verify: ranks must be in [1, {q64.shape[0]}] (at most the sequence "
                              f"length: every rank holds at least one token), got {ranks}")
    if (dq is not None or dk is not None or dv is not None) and dout is None:
        raise InvalidArgument("verify: dq, dk and dv are checked against the gradient of dout; "
                              "pass dout")
    if dtype is None:
        # Any bf16 result, not out's dtype alone: bf16 gradients with out=None (or an fp32 out)
        # were held to fp32's 1e-5, where loom verify --dtype bf16 holds them to bf16's.
        bf16 = [x is not None and x.dtype == torch.bfloat16 for x in (out, dq, dk, dv)]
        dtype = "bf16" if any(bf16) else "fp32"
    lse64 = flat(lse, "lse", batched_dims=3)  # [H, S], or [1, H, S] as attention() returns it
    text = _loom.verify_json(q64, k64, v64, flat(dout, "dout", candidate=False), causal, window,
                             scale, docs,
                             out64, lse64, flat(dq, "dq"), flat(dk, "dk"),
                             flat(dv, "dv"), layout, int(ranks), dtype, int(full_check_max))
    return json.loads(text)
