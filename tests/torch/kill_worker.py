"""The worker of test_kill.py (started by loom.torchrun): every rank enters a long ring
cp_attention; rank 1 is SIGKILLed from a timer thread while it is inside the call. The others
must raise loom.CommError (or loom.Timeout) within loom's timeout; each survivor writes what it
raised, and after how long, to $LOOM_KILL_DIR/rank<R>.txt and exits 3.
"""
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

import loom
import loom.torch as lt

dist.init_process_group("gloo")
rank, P = dist.get_rank(), dist.get_world_size()
out_dir = os.environ["LOOM_KILL_DIR"]
lt.set_timeout(float(os.environ.get("LOOM_KILL_TIMEOUT_S", "20")))
gen = torch.Generator().manual_seed(1)
S = 6000  # long enough that rank 1 is mid-call when it dies
q = lt.shard(torch.randn(1, S, 4, 64, generator=gen))
k = lt.shard(torch.randn(1, S, 4, 64, generator=gen))
dist.barrier()
if rank == 1:
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
t0 = time.time()
try:
    for _ in range(50):
        lt.cp_attention(q, k, k, strategy="ring")
    result = "nothing raised"
except loom.CommError as e:
    result = f"{type(e).__name__}: {e}"
elapsed = time.time() - t0
with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
    f.write(f"{elapsed:.3f}\n{result}\n")
sys.stdout.flush()
os._exit(3)
