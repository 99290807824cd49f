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
"$loom" train --ranks 4 --tp 2 --ring 2 "${args[@]}" --memory-limit 60M > /dev/null 2> "$work/err" &&
  { echo "FAIL the local 4 ranks fit in 60M: the check below proves nothing"; exit 1; }
grep -q "loom train with 4 ranks in this process needs about" "$work/err" ||
  { cat "$work/err"; echo "FAIL local refusal"; exit 1; }
"$mpiexec" -n 4 "$@" "$loom" train --tp 2 --ring 2 "${args[@]}" --memory-limit 60M > /dev/null 2> "$work/err" ||
  { cat "$work/err"; echo "FAIL mpirun ranks refused under a per-process --memory-limit they fit"; exit 1; }
echo "ok   --memory-limit 60M: 4 local ranks refused, 4 mpirun ranks run"
