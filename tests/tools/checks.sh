# Sourced by the tool check scripts (cli_checks.sh, train_check.sh, the mpirun fault checks): the
# pass/fail counters, the one-clear-error-line check, kill_job and mpi_job_scratch, written once.
# The sourcing script sets $loom (the binary) and $work (a scratch folder; mpi_job_scratch makes
# one) first, and ends with `summary`.
pass=0
fail=0
ok() { echo "ok   $1"; pass=$((pass + 1)); }
bad() { echo "FAIL $1"; fail=$((fail + 1)); }

# expect_error_of SUBCOMMAND NAME NEEDLE ARGS...: `loom SUBCOMMAND ARGS...` exits non-zero with
# exactly one line on stderr, containing NEEDLE. Leaves the output in $work/stdout, $work/stderr.
expect_error_of() {
  local sub="$1" name="$2" needle="$3"; shift 3
  "$loom" "$sub" "$@" > "$work/stdout" 2> "$work/stderr"
  local rc=$?
  local lines
  lines=$(wc -l < "$work/stderr")
  if [ "$rc" -ne 0 ] && [ "$lines" -eq 1 ] && grep -qF -- "$needle" "$work/stderr"; then
    ok "$name: $(cat "$work/stderr")"
  else
    echo "  rc=$rc stderr lines=$lines:"; cat "$work/stderr"; bad "$name"
  fi
}

# kill_job PID: ends a background mpirun job the script started (PID: mpirun's parent, as
# timeout(1)) and its ranks, stopped ones too, by pid: only the processes the script started.
kill_job() {
  local m c
  for m in $(pgrep -P "$1" 2> /dev/null); do
    for c in $(pgrep -P "$m" 2> /dev/null); do kill -CONT "$c"; kill -9 "$c"; done 2> /dev/null
    kill -9 "$m" 2> /dev/null
  done
  kill -9 "$1" 2> /dev/null
}

# mpi_job_scratch: for the mpirun fault checks, a fresh $work and an empty $pid (the background
# job a check starts, as for kill_job), both cleaned up when the script exits.
mpi_job_scratch() {
  work="$(mktemp -d)"
  pid=""
  trap '[ -n "$pid" ] && kill_job "$pid"; rm -rf "$work"' EXIT
}

# The counts, and the exit status: 0 when nothing failed.
summary() {
  echo "$pass passed, $fail failed"
  [ "$fail" -eq 0 ]
}
