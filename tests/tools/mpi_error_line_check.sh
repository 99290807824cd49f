#!/usr/bin/env bash
# Under mpirun a fault ends the job with one error line that names the rank at fault (docs/cli.md,
# Faults and timeouts), and rank 0's work alone after the last collective (its --check) does not
# count against the others' LOOM_FINALIZE_TIMEOUT_S. Each fault is a real SIGSTOP of one rank.
# Usage: mpi_error_line_check.sh MPIEXEC LOOM [MPIEXEC FLAGS...]
set -uo pipefail
mpiexec="$1"
loom="$2"
shift 2
source "$(dirname "$0")/checks.sh"  # ok, bad, kill_job, mpi_job_scratch
mpi_job_scratch
lines() { grep -c "loom: error" "$work/err"; }

# Starts `mpiexec -np NP ... loom ARGS` in the background (pid: timeout(1), mpirun's parent) and
# waits until its NP ranks exist.
start() {
  local np="$1"
  shift
  timeout 120 "$mpiexec" -np "$np" "$@" > "$work/out" 2> "$work/err" &
  pid=$!
  local n=0
  for _ in $(seq 150); do
    n=0
    for m in $(pgrep -P "$pid" 2> /dev/null); do n=$((n + $(pgrep -P "$m" 2> /dev/null | wc -l))); done
    [ "$n" -ge "$np" ] && return
    sleep 0.2
  done
}
# The pid of world rank $1 of the running job.
rank_pid() {
  for m in $(pgrep -P "$pid" 2> /dev/null); do
    for c in $(pgrep -P "$m" 2> /dev/null); do
      tr '\0' '\n' < "/proc/$c/environ" 2> /dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$1" &&
        echo "$c" && return
    done
  done
}
# Waits (up to $1 seconds) until world ranks 1 to $2 - 1 sleep in 5 samples in a row, 0.1 s
# apart: they have finished and wait for rank 0 at exit (polling every 20 ms), rank 0 works alone.
wait_alone() {
  local end=$((SECONDS + $1)) streak=0 p r sleeping
  while [ $SECONDS -lt $end ] && [ $streak -lt 5 ]; do
    sleeping=1
    for r in $(seq 1 $(($2 - 1))); do
      p=$(rank_pid "$r")
      [ -n "$p" ] && [ "$(awk '{print $3}' "/proc/$p/stat" 2> /dev/null)" = S ] || sleeping=0
    done
    if [ $sleeping -eq 1 ]; then streak=$((streak + 1)); else streak=0; fi
    sleep 0.1
  done
}
# Stops world rank $1 (SIGSTOP), waits for the job; sets rc, took (seconds after the stop).
stop_and_wait() {
  local victim t0
  victim=$(rank_pid "$1")
  t0=$(date +%s.%N)
  [ -n "$victim" ] && kill -STOP "$victim"
  wait "$pid"
  rc=$?
  took=$(echo "$(date +%s.%N) - $t0" | bc)
  [ -n "$victim" ] && { kill -CONT "$victim"; kill -9 "$victim"; } 2> /dev/null
  pid=""
  [ -n "$victim" ] || echo "  (world rank $1 not found)"
}
# rc non-zero (not timeout(1)'s 124), one loom line matching $2, within $3 seconds of the stop.
expect_one() {
  local what="$1" pattern="$2" bound="$3"
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$(lines)" -eq 1 ] &&
    grep -q -- "$pattern" "$work/err" && [ "$(echo "$took <= $bound" | bc)" -eq 1 ]; then
    ok "$what: one line after ${took}s: $(grep -m1 'loom: error' "$work/err")"
  else
    grep "loom: error" "$work/err"
    bad "$what: exit $rc after ${took}s (bound ${bound}s), $(lines) loom lines, wanted one matching '$pattern'"
  fi
}
ring=(attn --strategy ring --seq 2048 --heads 4 --head-dim 32 --backward --iters 100000
      --warmup 0 --quiet)

# 1. A ring of 4 with rank 2 stopped: rank 0 waits on rank 1 or 3, which wait on rank 2. Rank 0's
#    line named only its own neighbour ("send to rank 1 ... timed out"); now the ranks that time
#    out tell each other what they waited on, and the line names the one that reported nothing.
#    Bound: the timeout, rank 0's 2.5 s before it reports, and the tear-down.
LOOM_TIMEOUT_S=3 start 4 "$@" -x LOOM_TIMEOUT_S "$loom" "${ring[@]}"
sleep 2
stop_and_wait 2
expect_one "rank 2 of a ring of 4 stopped" "rank 2 stopped or is slow: it reported no timeout" 9

# 2. Rank 0 stopped: ranks 1 to 3 time out together and each printed its line (3 lines); now
#    they print in rank order and the first one printed ends the others' turn.
LOOM_TIMEOUT_S=3 start 4 "$@" -x LOOM_TIMEOUT_S "$loom" "${ring[@]}"
sleep 2
stop_and_wait 0
expect_one "rank 0 of a ring of 4 stopped" "rank 1: .*rank 0 stopped or is slow" 10

# 3. A rank stopped during rank 0's --check, after the last collective: the other ranks wait for
#    rank 0 at exit, LOOM_FINALIZE_TIMEOUT_S after its last word that it was still working; they
#    reached the limit together and printed 3 lines. Rank 0's check here takes about 35 s, the
#    attention about 1 s.
LOOM_FINALIZE_TIMEOUT_S=3 start 4 "$@" -x LOOM_FINALIZE_TIMEOUT_S "$loom" attn --seq 4096 \
  --heads 8 --head-dim 64 --backward --check --iters 1 --warmup 0 --quiet
wait_alone 20 4
stop_and_wait 0
expect_one "rank 0 stopped during its --check" \
  "rank 1: the other ranks did not finish within 3 s after this one (LOOM_FINALIZE_TIMEOUT_S).*rank 0 stopped" 9

# 4. MPI_Init's watchdog (a process of the job that never initialises MPI): every loom rank's
#    fired at the same moment (3 lines); now rank 0's comes first and ends the job.
t0=$(date +%s.%N)
LOOM_TIMEOUT_S=1 timeout 60 "$mpiexec" -np 3 "$@" -x LOOM_TIMEOUT_S "$loom" attn --seq 64 \
  --quiet : -np 1 "$@" sleep 60 > "$work/out" 2> "$work/err"
rc=$?
took=$(echo "$(date +%s.%N) - $t0" | bc)
expect_one "MPI_Init's watchdog" "rank 0: MPI initialisation did not complete within 10 s" 20

# 5. A healthy --check that outlasts LOOM_FINALIZE_TIMEOUT_S (about 3 s against 1 s): the other
#    ranks gave up on rank 0 after 1 s and ended the job with exit 1, no report and no --json.
if LOOM_FINALIZE_TIMEOUT_S=1 timeout 120 "$mpiexec" -np 2 "$@" -x LOOM_FINALIZE_TIMEOUT_S "$loom" \
     attn --seq 3072 --heads 4 --head-dim 32 --backward --check --iters 1 --warmup 0 --quiet \
     --json "$work/r.json" > "$work/out" 2> "$work/err" &&
  grep -q "check     passed" "$work/out" && [ -s "$work/r.json" ]; then
  ok "a --check longer than LOOM_FINALIZE_TIMEOUT_S=1 passes"
else
  cat "$work/err"
  bad "a --check longer than LOOM_FINALIZE_TIMEOUT_S=1 failed"
fi

summary
