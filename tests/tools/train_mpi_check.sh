#!/usr/bin/env bash
# `loom train` under mpirun (tp 2 x ring 2 on 4 processes) logs the one-rank local run's losses
# (1e-5 relative). Usage: train_mpi_check.sh MPIEXEC LOOM_BINARY [mpiexec flags...]
set -uo pipefail
mpiexec="$1"
loom="$2"
shift 2
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 - "$work/text.txt" <<'PY'
import random, sys
random.seed(5)
words = "the lord said unto moses and people of israel went out land water light day".split()
with open(sys.argv[1], "w") as f:
    for p in range(60):
        for s in range(5):
            f.write(" ".join(random.choice(words) for _ in range(random.randint(4, 11))) + ".\n")
        f.write("\n")
PY
args=(--seq 128 --layers 2 --dim 32 --heads 4 --kv-heads 2 --steps 5 --batch 2 --seed 4 --quiet
      --eval-every 0 --data "$work/text.txt")
"$mpiexec" -n 4 "$@" "$loom" train --tp 2 --ring 2 "${args[@]}" --log "$work/mpi.jsonl" ||
  { echo "FAIL mpirun run"; exit 1; }
"$loom" train --ranks 1 "${args[@]}" --log "$work/one.jsonl" > /dev/null ||
  { echo "FAIL one-rank run"; exit 1; }
/usr/bin/python3 - "$work/mpi.jsonl" "$work/one.jsonl" <<'PY'
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1])]
b = [json.loads(l)["loss"] for l in open(sys.argv[2])]
assert len(a) == 5 and len(b) == 5, (a, b)
worst = max(abs(x - y) / y for x, y in zip(a, b))
assert worst <= 1e-5, (a, b)
print("ok   mpirun tp2 x ring2 == one rank (max rel diff %.2e)" % worst)
PY
# --memory-limit bounds one process: under mpirun one rank. It counted every rank of the node in
# each process and refused a run whose processes fitted; the limit here refuses the local
# backend's 4 ranks in one process and passes each mpirun rank.
"$loom" train --ranks 4 --tp 2 --ring 2 "${args[@]}" --memory-limit 32M > /dev/null 2> "$work/err" &&
  { echo "FAIL the local 4 ranks fit in 32M: the check below proves nothing"; exit 1; }
grep -q "loom train with 4 ranks in this process needs about" "$work/err" ||
  { cat "$work/err"; echo "FAIL local refusal"; exit 1; }
"$mpiexec" -n 4 "$@" "$loom" train --tp 2 --ring 2 "${args[@]}" --memory-limit 32M > /dev/null 2> "$work/err" ||
  { cat "$work/err"; echo "FAIL mpirun ranks refused under a per-process --memory-limit they fit"; exit 1; }
echo "ok   --memory-limit 32M: 4 local ranks refused, 4 mpirun ranks run"
# A tp peer that stops during a checkpoint save (LOOM_TEST_STOP_IN_CHECKPOINT=2: world rank 1
# stops itself in the save of step 2, before it sends rank 0 anything): rank 0, waiting for its
# pieces, times out after LOOM_TIMEOUT_S and ends the job. It waited max(LOOM_TIMEOUT_S, 600 s),
# the allowance meant for the ranks that wait on rank 0's disk, and the job hung 10 minutes. The
# one line says where in the run (it named neither the step nor the checkpoint save) and which
# rank went silent.
mkdir -p "$work/stop"
t0=$SECONDS
(cd "$work/stop" && LOOM_TIMEOUT_S=2 LOOM_TEST_STOP_IN_CHECKPOINT=2 timeout 100 "$mpiexec" -n 2 "$@" \
  -x LOOM_TIMEOUT_S -x LOOM_TEST_STOP_IN_CHECKPOINT "$loom" train --tp 2 "${args[@]}" \
  --checkpoint-dir ck --checkpoint-every 1 > /dev/null 2> err)
rc=$? took=$((SECONDS - t0))
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $took -le 20 ] &&
  [ "$(grep -c "loom: error" "$work/stop/err")" -eq 1 ] &&
  grep -q "rank 0: .*timed out after 2 s (in step 2, checkpoint save); rank 1 stopped or is slow" \
    "$work/stop/err"; then
  echo "ok   a tp peer stopped during a checkpoint save ends the job in $took s (LOOM_TIMEOUT_S=2)"
else
  cat "$work/stop/err"
  echo "FAIL a tp peer stopped during a checkpoint save: exit $rc after $took s"
  exit 1
fi
# Temporaries that a process on another node, or in another PID namespace, writes: a pid is
# looked up there only, so every rank took them for a dead run's and deleted them (a second job,
# refused by the running one's lock on its rank 0, deleted the running job's checkpoint
# temporary from its other ranks, and that job failed at its rename). Only the rank that holds
# the checkpoint directory's lock sweeps it, and only rank 0 --log's. Rank 1 runs in a PID
# namespace of its own, where the writer (a live process here) is not seen.
if unshare --pid --fork true 2> /dev/null; then
  sleep 300 &
  writer=$!
  mkdir -p "$work/ns/ck"
  : > "$work/ns/ck/step-00000009.ckpt.tmp.$writer-0"
  : > "$work/ns/log.jsonl.tmp.$writer-0"
  (cd "$work/ns" && timeout 100 "$mpiexec" --mca btl tcp,self -n 1 "$@" "$loom" train "${args[@]}" \
    --checkpoint-dir ck --checkpoint-every 5 --log log.jsonl : -n 1 "$@" unshare --pid --fork \
    "$loom" train "${args[@]}" --checkpoint-dir ck --checkpoint-every 5 --log log.jsonl \
    > /dev/null 2> err)
  rc=$?
  kill "$writer" 2> /dev/null
  if [ $rc -eq 0 ] && [ -e "$work/ns/ck/step-00000009.ckpt.tmp.$writer-0" ] &&
    [ -e "$work/ns/log.jsonl.tmp.$writer-0" ] && [ -e "$work/ns/ck/step-00000005.ckpt" ]; then
    echo "ok   a rank in another PID namespace leaves a live writer's temporaries alone"
  else
    cat "$work/ns/err"
    ls "$work/ns" "$work/ns/ck"
    echo "FAIL temporaries of a live writer (pid $writer) with rank 1 in another PID namespace (exit $rc)"
    exit 1
  fi
else
  echo "skip the PID-namespace check (unshare --pid --fork is not permitted here)"
fi
