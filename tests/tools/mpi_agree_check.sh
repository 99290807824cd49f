#!/usr/bin/env bash
# Under mpirun, a rank that fails or differs ends the whole job at once with one line naming it:
# ranks started with other arguments (MPMD), reading other --input bytes or resuming from other
# checkpoints (node-local directories), failing alone (a bad LOOM_TIMEOUT_S), or exiting before
# initialising MPI. Before, the others waited out their timeout (or for ever, in MPI_Init),
# crashed inside MPI (SIGSEGV), or exited 0 with wrong results and checkpoints.
# Usage: mpi_agree_check.sh MPIEXEC LOOM_BINARY [mpiexec flags...]
set -uo pipefail
mpiexec="$1"
loom="$(realpath "$2")"
shift 2
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fails=0
ok() { echo "ok   $1"; }
bad() { echo "FAIL $1"; fails=$((fails + 1)); }
# expect NAME TEXT -- mpiexec args...: non-zero exit within 20 s (the ranks' timeout is 30 s), TEXT
# on stderr, no crash.
expect() {
  local name=$1 text=$2
  shift 3
  local t0=$SECONDS
  LOOM_TIMEOUT_S=30 timeout 100 "$mpiexec" "$@" > "$work/out" 2> "$work/err"
  local rc=$? took=$((SECONDS - t0))
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $took -le 20 ] && grep -qF -- "$text" "$work/err" &&
    ! grep -q "Segmentation\|signal 11" "$work/err"; then
    ok "$name ($took s)"
  else
    cat "$work/err"
    bad "$name: exit $rc after $took s, wanted '$text'"
  fi
}
attn=(attn --seq 64 --heads 2 --head-dim 16 --iters 1 --warmup 0 --quiet)
expect "other arguments on one rank (MPMD)" "rank 1 was started with other arguments than rank 0" -- \
  -np 1 "$@" "$loom" "${attn[@]}" : -np 1 "$@" "$loom" "${attn[@]}" --no-causal
expect "an error on one rank only ends the job at once, naming it" \
  "rank 1: LOOM_TIMEOUT_S must be a decimal number of seconds" -- \
  -np 1 "$@" "$loom" "${attn[@]}" : -np 1 "$@" -x LOOM_TIMEOUT_S=abc "$loom" "${attn[@]}"
# A configuration error every rank finds (after they agreed on the command line): one line, rank
# 0's (each of 5 ranks printed it).
expect "a configuration error of every rank" "ring2d: --inner 2 must divide the number of ranks 5" -- \
  -np 5 "$@" "$loom" "${attn[@]}" --strategy ring2d --inner 2
[ "$(grep -c "loom: error" "$work/err")" -eq 1 ] && ok "... printed once" ||
  { cat "$work/err"; bad "a configuration error printed $(grep -c "loom: error" "$work/err") times"; }
# A rank that exits (status 0) before initialising MPI: the others waited in MPI_Init for ever.
# Their initialisation deadline is LOOM_TIMEOUT_S with a floor of 10 s.
expect "a rank that exits 0 before initialising MPI ends the job" \
  "rank 1: MPI initialisation did not complete within 10 s" -- \
  -np 1 "$@" sh -c "exit 0" : -np 1 "$@" -x LOOM_TIMEOUT_S=1 "$loom" "${attn[@]}"
# The same command line in two directories holding different files (node-local inputs).
for d in a b; do
  mkdir -p "$work/$d/ck"
  /usr/bin/python3 - "$work/$d/in" "$d" <<'PY'
import numpy as np, os, sys
os.makedirs(sys.argv[1])
r = np.random.default_rng(1 if sys.argv[2] == "a" else 2)
for n in ("q", "k", "v"):
    np.save(f"{sys.argv[1]}/{n}.npy", r.standard_normal((32, 2, 8)).astype(np.float32))
PY
done
expect "other --input bytes on one rank" "rank 1 read other --input files than rank 0" -- \
  -np 1 "$@" -wdir "$work/a" "$loom" attn --input in --quiet --iters 1 --warmup 0 : \
  -np 1 "$@" -wdir "$work/b" "$loom" attn --input in --quiet --iters 1 --warmup 0
# A rank's own error reaches the user before the timeouts it causes: rank 1's k.npy holds a NaN,
# and with LOOM_TIMEOUT_S=1 rank 0's all-gather timed out and ended the job before rank 1's
# two seconds were up, so its timeout was the only line.
mkdir -p "$work/c"
/usr/bin/python3 - "$work/a/in" "$work/c/in" <<'PY'
import numpy as np, os, shutil, sys
shutil.copytree(sys.argv[1], sys.argv[2])
k = np.load(f"{sys.argv[2]}/k.npy")
k[1, 0, 3] = np.nan
np.save(f"{sys.argv[2]}/k.npy", k)
PY
expect "a rank's own error under LOOM_TIMEOUT_S=1" "rank 1: k.npy contains a non-finite value" -- \
  -np 1 "$@" -x LOOM_TIMEOUT_S=1 -wdir "$work/a" "$loom" attn --input in --quiet : \
  -np 1 "$@" -x LOOM_TIMEOUT_S=1 -wdir "$work/c" "$loom" attn --input in --quiet
# A usage error on one rank (MPMD) names it.
expect "a usage error on one rank names it" \
  "rank 1: The following argument was not expected: --bogus (see loom --help)" -- \
  -np 1 "$@" "$loom" "${attn[@]}" : -np 1 "$@" "$loom" "${attn[@]}" --bogus
# Under mpirun the ranks of a node together must fit in its available memory (each was checked
# alone against all of it); a size each rank's estimate is already over shows what is counted.
# --memory-limit bounds one process, one rank (as in loom train): 4 local ranks in one process
# are refused under 120M, each of 4 mpirun ranks fits.
avail_kib=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)
seq=$(( (avail_kib / 24 / 1024 + 1) * 1024 ))  # 1.5x the available memory on each of 4 ranks
expect "loom attn under mpirun: the node's ranks together" \
  "loom attn with 4 ranks on this node needs about" -- \
  -np 4 "$@" "$loom" attn --seq "$seq" --heads 32 --head-dim 128 --quiet
mem=(attn --seq 32768 --heads 4 --head-dim 32 --quiet --iters 1 --warmup 0 --memory-limit 120M)
if "$loom" "${mem[@]}" --ranks 4 > /dev/null 2> "$work/err"; then
  bad "4 local ranks fit in 120M: the check below proves nothing"
elif ! grep -q "loom attn with 4 ranks needs about" "$work/err"; then
  cat "$work/err"; bad "4 local ranks under 120M: not the memory refusal"
elif timeout 100 "$mpiexec" -np 4 "$@" "$loom" "${mem[@]}" > /dev/null 2> "$work/err"; then
  ok "--memory-limit 120M: 4 local ranks refused, 4 mpirun ranks of loom attn run"
else
  cat "$work/err"; bad "mpirun ranks of loom attn refused under a per-process --memory-limit they fit"
fi
# loom verify and loom plan (but --calibrate) use no other rank: under mpirun every rank printed
# its report and rewrote --json. Rank 0 alone runs them.
profile="$(dirname "$0")/../../plan/profiles/h100_sxm.json"
: > "$work/out2"
(cd "$work/a" && "$loom" attn --input in --output cand --quiet > /dev/null) ||
  bad "the local run that writes the candidate"
if timeout 60 "$mpiexec" -np 2 "$@" -wdir "$work/a" "$loom" verify --input in --candidate cand \
    --json v.json > "$work/out" 2> "$work/err" && [ "$(grep -c '^verify ' "$work/out")" = 1 ] &&
  [ -s "$work/a/v.json" ] && timeout 60 "$mpiexec" -np 2 "$@" "$loom" plan --profile "$profile" \
    --devices 8 --seq 16384 --top 2 --json "$work/p.json" > "$work/out2" 2>> "$work/err" &&
  [ "$(grep -c '^loom plan: model' "$work/out2")" = 1 ] && [ -s "$work/p.json" ]; then
  ok "loom verify and loom plan under mpirun: one report, rank 0's"
else
  cat "$work/out" "$work/out2" "$work/err"
  bad "loom verify / loom plan under mpirun: $(grep -c '^verify ' "$work/out") verify and $(grep -c '^loom plan: model' "$work/out2") plan reports"
fi
# Node-local checkpoint directories at different steps: the same --resume on every rank.
/usr/bin/python3 - "$work/text.txt" <<'PY'
import sys
with open(sys.argv[1], "w") as f:
    f.write("the lord said unto moses and the people of israel went out. " * 400)
PY
train=(train --seq 64 --layers 1 --dim 16 --heads 2 --kv-heads 1 --batch 1 --seed 3 --quiet
       --eval-every 0 --data "$work/text.txt" --checkpoint-every 1 --checkpoint-dir ck)
# One run writes steps 1..4; node a's latest names step 3, node b's step 2.
(cd "$work/a" && "$loom" "${train[@]}" --ranks 2 --steps 6 --keep-checkpoints 10 > /dev/null &&
  cp -r ck ../b/ && echo step-00000003.ckpt > ck/latest &&
  echo step-00000002.ckpt > ../b/ck/latest && rm ck/step-0000000[456].ckpt ../b/ck/step-0000000[3456].ckpt) ||
  bad "the local run that writes the checkpoints"
expect "--resume from other checkpoints on one rank" "--resume: rank 1 read a checkpoint of step 2" -- \
  -np 1 "$@" -wdir "$work/a" "$loom" "${train[@]}" --steps 6 --resume : \
  -np 1 "$@" -wdir "$work/b" "$loom" "${train[@]}" --steps 6 --resume
[ -e "$work/a/ck/step-00000004.ckpt" ] && bad "rank 0 wrote a checkpoint after the refused resume" ||
  ok "no checkpoint written after the refused resume"
# loom train's errors every rank finds, printed once (rank 0's): its mesh and strategy rules ran
# before the ranks agreed, and only InvalidArgument was printed once, so a usage error, a mesh of
# the wrong size and non-finite training each printed 4 lines.
once() {
  [ "$(grep -c "loom: error" "$work/err")" -eq 1 ] && ok "... printed once" ||
    { cat "$work/err"; bad "$1 printed $(grep -c "loom: error" "$work/err") times"; }
}
small=(train --seq 64 --layers 1 --dim 16 --heads 2 --kv-heads 1 --batch 1 --seed 3 --quiet
       --eval-every 0 --steps 3 --data "$work/text.txt")
expect "train: a usage error" "--tp: Value 0 not in range" -- -np 4 "$@" "$loom" "${small[@]}" --tp 0
once "a usage error"
expect "train: a mesh that is not the world" "= 3 ranks does not match the 4 ranks of this run" -- \
  -np 4 "$@" "$loom" "${small[@]}" --tp 3
once "a mesh of 3 ranks"
expect "train: non-finite training" "non-finite training at step 2" -- \
  -np 4 "$@" -x LOOM_TEST_NAN_AT_STEP=2 "$loom" "${small[@]}" --ring 4
once "non-finite training"
# Open MPI gives standard input to rank 0 only: the others were refused as reading "other --data".
expect "train: --data - under mpirun" "--data - (standard input) cannot be used under mpirun" -- \
  -np 2 "$@" "$loom" "${small[@]/$work\/text.txt/-}"
once "--data -"
# A rank stopped after the last collective (here during rank 0's fp64 --check): the others wait
# in MPI_Finalize, which has no timeout, and waited for ever. Now LOOM_FINALIZE_TIMEOUT_S (by
# default max(10 x LOOM_TIMEOUT_S, 600 s)), then one line and the job ends.
LOOM_FINALIZE_TIMEOUT_S=5 timeout 60 "$mpiexec" -np 2 "$@" -x LOOM_FINALIZE_TIMEOUT_S "$loom" attn --seq 3072 \
  --heads 4 --head-dim 32 --iters 1 --warmup 0 --check --backward --quiet > "$work/out" \
  2> "$work/err" &
job=$!
kids=""
for _ in $(seq 100); do
  mp=$(pgrep -P "$job" | head -1)
  [ -n "$mp" ] && kids=$(pgrep -P "$mp" | tr '\n' ' ')
  [ "$(echo $kids | wc -w)" -ge 2 ] && break
  sleep 0.1
done
sleep 1.5  # the attention is done (0.1 s); rank 0's check takes about 3 s
r0=""
for p in $kids; do
  [ "$(tr '\0' '\n' < /proc/$p/environ 2> /dev/null | grep '^OMPI_COMM_WORLD_RANK=')" = \
    "OMPI_COMM_WORLD_RANK=0" ] && r0=$p
done
t0=$SECONDS
[ -n "$r0" ] && kill -STOP "$r0"
wait "$job"
rc=$?
took=$((SECONDS - t0))
[ -n "$r0" ] && { kill -CONT "$r0"; kill -9 "$r0"; } 2> /dev/null
if [ -n "$r0" ] && [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $took -le 20 ] &&
  grep -q "rank 1: the other ranks did not finish within 5 s after this one (LOOM_FINALIZE_TIMEOUT_S)" "$work/err"; then
  ok "a rank stopped after the last collective ends the job from MPI_Finalize ($took s)"
else
  cat "$work/err"
  bad "a rank stopped after the last collective: exit $rc after $took s (rank 0: '$r0')"
fi
# The largest timeout: MPI_Finalize's watchdog (10 x 1e9 s) is held to 1e9 s, which wait_for can
# take (past 9.2e9 s its nanoseconds overflowed and the wait returned at once: every rank would
# have ended in MPI_Finalize with the watchdog's error). A bad LOOM_FINALIZE_TIMEOUT_S is refused.
if LOOM_TIMEOUT_S=1e9 timeout 60 "$mpiexec" -np 2 "$@" -x LOOM_TIMEOUT_S "$loom" "${attn[@]}" \
     > "$work/out" 2> "$work/err"; then
  ok "LOOM_TIMEOUT_S=1e9 under mpirun ends normally"
else
  cat "$work/err"; bad "LOOM_TIMEOUT_S=1e9 under mpirun"
fi
expect "LOOM_FINALIZE_TIMEOUT_S=0 refused" \
  "LOOM_FINALIZE_TIMEOUT_S must be a decimal number of seconds from 0.001 to 1e9, got '0'" -- \
  -np 2 "$@" -x LOOM_FINALIZE_TIMEOUT_S=0 "$loom" "${attn[@]}"
# plan --calibrate: the other ranks wait while rank 0 calibrates (seconds), not under the
# communication timeout (LOOM_TIMEOUT_S=2 failed a healthy calibration: "barrier ... timed out");
# rank 0 alone prints the banner (every rank did).
if LOOM_TIMEOUT_S=2 timeout 200 "$mpiexec" -np 2 "$@" -x LOOM_TIMEOUT_S "$loom" plan \
    --calibrate "$work/cal.json" > /dev/null 2> "$work/err" && [ -s "$work/cal.json" ] &&
  [ "$(grep -c 'calibrating this machine' "$work/err")" = 1 ]; then
  ok "plan --calibrate under mpirun outlasts LOOM_TIMEOUT_S=2 (one banner, rank 0's)"
else
  cat "$work/err"
  bad "plan --calibrate under mpirun with LOOM_TIMEOUT_S=2"
fi
# The report's config names the run's ranks (mpirun's -np), not --ranks' default of 1 beside
# "world": 2.
if timeout 100 "$mpiexec" -np 2 "$@" "$loom" "${attn[@]}" --json "$work/r.json" > /dev/null \
    2> "$work/err" && /usr/bin/python3 -c "import json, sys; r = json.load(open(sys.argv[1]))
assert r['config']['ranks'] == r['world'] == 2, (r['config']['ranks'], r['world'])" "$work/r.json"
then
  ok "--json's config.ranks under mpirun is -np"
else
  cat "$work/err"; bad "--json's config.ranks under mpirun"
fi
[ $fails -eq 0 ] && echo "all mpirun agreement checks passed" || { echo "$fails failed"; exit 1; }
