"""The worker of test_kill.py (started by loom.torchrun): every rank enters a long ring
cp_attention; rank 1 is SIGKILLed from a timer thread while it is inside the call. The others
must raise loom.CommError (or loom.Timeout) within loom's timeout; each survivor writes what it
raised, after how long, and whether the launcher had asked it to stop, to
$LOOM_KILL_DIR/rank<R>.txt and exits 3.

torchrun SIGTERMs the survivors as soon as its monitor sees rank 1 dead (every second here) and
SIGKILLs them 30 s later. On a loaded machine a survivor may not have reached its next message
within that second, and would die before it could show what loom raised. So the survivors note
the SIGTERM and go on: the test checks loom's error, and the 30 s still bound the job.
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
sigterm_at = []
signal.signal(signal.SIGTERM, lambda *_: sigterm_at.append(time.time()))
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
    asked = f"SIGTERM after {sigterm_at[0] - t0:.3f} s" if sigterm_at else "no SIGTERM"
    f.write(f"{elapsed:.3f}\n{asked}\n{result}\n")
sys.stdout.flush()
os._exit(3)
