"""torchrun that works on Debian bookworm: /usr/bin/python3 -m loom.torchrun [torchrun args].

Three fixes, then torch.distributed.run unchanged; the workers it starts are plain processes of the
given script.

1. Debian's torch 1.13 with Python 3.11 crashes in torchrun before starting any worker
   ("AttributeError: 'NoneType' object has no attribute 'get'" in elastic/multiprocessing/api.py
   to_map): iterating the Std flag enum yields only its one-bit members OUT and ERR on Python
   3.11, neither NONE (0) nor ALL (3), so the default `--redirects 0 --tee 0` parses to None, and
   so does 3. The wrapper parses `--redirects` and `--tee` itself (std_from_str): 0 none, 1
   stdout, 2 stderr, 3 both, for every local rank or per local rank as `i:v,j:w` (`0:3,1:1`;
   ranks not named get 0), as torchrun documents; anything else, a local rank named twice or one
   at or above --nproc_per_node is refused with one line before any worker starts.

2. With a c10d rendezvous (`--standalone`, or `--rdzv_backend c10d`) the agent picks the workers'
   MASTER_PORT by binding port 0, reads the port the kernel gave, closes the socket, and rank 0
   binds it again seconds later. Port 0 draws from the ephemeral range
   (/proc/sys/net/ipv4/ip_local_port_range), the same range the kernel draws the source port of
   every outgoing connection from, so a connection made in between can take the port and rank 0
   fails with "errno: 98 - Address already in use". The wrapper picks a free port outside that
   range instead: no outgoing connection is ever given one of those, so only a process that
   binds that very port by number can race it.

3. `--standalone` hosts the rendezvous store on port 29400, always; a second job started on the
   same machine while the first runs finds 29400 taken and, without a word, becomes a client of
   the first job's store: when the first job ends, the second one's agent loses its store and
   kills its healthy workers ("RendezvousConnectionError ... Broken pipe"). The wrapper gives
   each `--standalone` job its own store, on a free port outside the ephemeral range (as in 2),
   with a fresh rendezvous id: what --standalone means, one job on one node.

4. Without `--log_dir`, the agent makes a directory `torchelastic_*` in the temporary directory
   (TMPDIR, else /tmp) for the workers' redirected output and never removes it: every job left
   one, empty unless `--redirects` or `--tee` wrote there. The wrapper makes that directory itself
   and, when the job ends (whatever its outcome), removes the directories in it that hold no file;
   where workers' logs remain, it says where on stderr. No file is ever deleted.
"""
import os
import random
import re
import socket
import sys
import tempfile
import uuid

from torch.distributed.elastic.agent.server import api as _agent_api
from torch.distributed.elastic.multiprocessing import api as _api
import torch.distributed.run as _run
from torch.distributed.elastic.multiprocessing.errors import record as _record

# Ports below this need privileges on most systems; never chosen.
_FIRST_UNPRIVILEGED = 1024
_LAST_PORT = 65535


def ephemeral_range(path="/proc/sys/net/ipv4/ip_local_port_range"):
    """(low, high): the kernel's ephemeral port range, both ends included; Linux's default
    (32768, 60999) where the file cannot be read."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
        if _FIRST_UNPRIVILEGED <= low <= high <= _LAST_PORT:
            return low, high
    except (OSError, ValueError):
        pass
    return 32768, 60999


def candidate_ports(low, high):
    """Every unprivileged port outside [low, high], from a random one on (wrapping around)."""
    ports = list(range(_FIRST_UNPRIVILEGED, low)) + list(range(high + 1, _LAST_PORT + 1))
    start = random.SystemRandom().randrange(len(ports))
    return ports[start:] + ports[:start]


def socket_with_port_outside_ephemeral_range():
    """A TCP socket bound on localhost to a free port outside the ephemeral range (the replacement
    for torch's _get_socket_with_port, same contract: the caller reads the port and closes it).
    Raises RuntimeError when no such port is free."""
    low, high = ephemeral_range()
    addrs = socket.getaddrinfo(host="localhost", port=None, family=socket.AF_UNSPEC,
                               type=socket.SOCK_STREAM)
    for port in candidate_ports(low, high):
        for family, type_, proto, _, _ in addrs:
            s = socket.socket(family, type_, proto)
            try:
                s.bind(("localhost", port))
                s.listen(0)
                return s
            except OSError:
                s.close()
    raise RuntimeError(f"loom.torchrun: no free port on localhost outside the ephemeral range "
                       f"{low}-{high}")


_STD_VALUE = re.compile(r"[0-3]")
_STD_MAP = re.compile(r"\d+:[0-3](,\d+:[0-3])*")


def std_from_str(vm):
    """torchrun's --redirects / --tee value as Std.from_str documents it, on every Python: "0"
    NONE, "1" OUT, "2" ERR, "3" ALL, or "i:v,j:w" -> {i: Std(v), j: Std(w)} per local rank.
    ValueError, with the accepted forms, for anything else (a local rank named twice too)."""
    text = vm.strip() if isinstance(vm, str) else ""
    if _STD_VALUE.fullmatch(text):
        return _api.Std(int(text))
    if _STD_MAP.fullmatch(text):
        result = {}
        for item in text.split(","):
            rank, value = (int(x) for x in item.split(":"))
            if rank in result:
                raise ValueError(f"{vm!r} names local rank {rank} twice")
            result[rank] = _api.Std(value)
        return result
    raise ValueError(f"{vm!r} is not 0 (none), 1 (stdout), 2 (stderr), 3 (both) or a list of "
                     f"local_rank:value (e.g. 0:3,1:1)")


def check_std_args(args):
    """--redirects and --tee (or PET_REDIRECTS / PET_TEE) as std_from_str takes them, and no local
    rank beyond --nproc_per_node (torch ignored it without a word); SystemExit with one line
    naming the option otherwise."""
    nproc = str(getattr(args, "nproc_per_node", ""))
    for name in ("redirects", "tee"):
        value = getattr(args, name)
        try:
            parsed = std_from_str(value)
        except ValueError as e:
            raise SystemExit(f"loom.torchrun: --{name}: {e}") from None
        if isinstance(parsed, dict) and nproc.isdigit():
            beyond = sorted(r for r in parsed if r >= int(nproc))
            if beyond:
                raise SystemExit(f"loom.torchrun: --{name} {value}: local rank {beyond[0]} does "
                                 f"not exist (--nproc_per_node {nproc}: local ranks 0 to "
                                 f"{int(nproc) - 1})")


def _patch():
    _api.Std.from_str = staticmethod(std_from_str)
    # SimpleElasticAgent._set_master_addr_port looks the function up in its module at call time.
    _agent_api._get_socket_with_port = socket_with_port_outside_ephemeral_range


def standalone_args(args):
    """--standalone as torchrun sets it up (a c10d rendezvous on localhost, a fresh id), but on a
    free port of this job's own instead of 29400 (fix 3). Other arguments are left alone."""
    if getattr(args, "standalone", False):
        s = socket_with_port_outside_ephemeral_range()
        port = s.getsockname()[1]
        s.close()
        args.standalone = False
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = f"localhost:{port}"
        args.rdzv_id = str(uuid.uuid4())
    return args


def remove_empty_dirs(top):
    """Removes the directories under top, and top, that hold no file (fix 4); returns whether top
    is gone. A directory with a file in it anywhere below is kept, with the file."""
    for root, _, _ in os.walk(top, topdown=False):
        try:
            os.rmdir(root)
        except OSError:
            pass  # not empty: a file somewhere below, or not ours to remove
    return not os.path.exists(top)


@_record
def main(argv=None):
    _patch()
    args = _run.parse_args(argv if argv is not None else sys.argv[1:])
    check_std_args(args)
    own_log_dir = None
    if not getattr(args, "log_dir", None):
        own_log_dir = args.log_dir = tempfile.mkdtemp(prefix="torchelastic_")
    try:
        _run.run(standalone_args(args))
    finally:
        if own_log_dir and not remove_empty_dirs(own_log_dir):
            print(f"loom.torchrun: the workers' logs are in {own_log_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
