#!/usr/bin/env bash
# A bounded random-fault soak of `loom attn` on the local backend: runs with a kill, a dropped
# message or a delay injected at a random operation of a random rank, over random strategies,
# layouts and world sizes, for about SECONDS. Every run must end either correct (--check passed,
# exit 0) or with exactly one error line and a non-zero exit, within 2x LOOM_TIMEOUT_S; never a
# hang, never a crash (a signal), never a wrong answer. Usage: fault_soak.sh LOOM SECONDS [SEED]
set -uo pipefail
loom="$1"
seconds="${2:-60}"
RANDOM="${3:-11}"  # reproducible draws
timeout_s=3
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
runs=0 ok_runs=0 err_runs=0 fail=0
end=$(( $(date +%s) + seconds ))
strategies=(ring ulysses hybrid allgather)
layouts=(contiguous zigzag stripe)
while [ "$(date +%s)" -lt "$end" ]; do
  ranks=$(( 2 + RANDOM % 3 ))           # 2..4
  strategy=${strategies[RANDOM % 4]}
  layout=${layouts[RANDOM % 3]}
  extra=()
  if [ "$strategy" = hybrid ]; then
    ranks=4
    extra=(--ulysses 2)
  fi
  rank=$(( RANDOM % ranks ))
  case $(( RANDOM % 4 )) in
    0) fault="kill:$rank,at=$(( RANDOM % 40 ))" ;;
    1) fault="drop:$rank,at=$(( RANDOM % 40 ))" ;;
    2) fault="delay:$rank:$(( RANDOM % 30 ))" ;;
    3) fault="" ;;
  esac
  seq=$(( 17 + RANDOM % 200 ))
  heads=(--heads 4 --kv-heads 2)
  [ "$strategy" = ulysses ] && heads=(--heads 12 --kv-heads 12)  # divisible by 2, 3 and 4
  args=(attn --ranks "$ranks" --strategy "$strategy" --layout "$layout" "${extra[@]}"
        --seq "$seq" "${heads[@]}" --head-dim 16 --iters 2 --warmup 0 --check --quiet)
  [ $(( RANDOM % 2 )) -eq 0 ] && args+=(--backward)
  [ -n "$fault" ] && args+=(--fault "$fault")
  t0=$(date +%s.%N)
  LOOM_TIMEOUT_S=$timeout_s timeout $(( 4 * timeout_s )) "$loom" "${args[@]}" \
    > "$work/out" 2> "$work/err"
  rc=$?
  el=$(echo "$(date +%s.%N) - $t0" | bc)
  runs=$((runs + 1))
  lines=$(wc -l < "$work/err")
  verdict=""
  if [ "$rc" -eq 0 ]; then
    grep -q "check     passed" "$work/out" || verdict="exit 0 without a passed check"
    [ "$lines" -eq 0 ] || verdict="exit 0 with stderr output"
    ok_runs=$((ok_runs + 1))
  elif [ "$rc" -eq 124 ] || [ "$rc" -ge 128 ]; then
    verdict="hang or crash (exit $rc)"
  else
    [ "$lines" -eq 1 ] && grep -q "^loom: error: " "$work/err" ||
      verdict="exit $rc with $lines stderr lines"
    grep -q "check failed" "$work/err" && verdict="wrong answer"
    err_runs=$((err_runs + 1))
  fi
  if [ -z "$verdict" ] && [ "$(echo "$el > 2 * $timeout_s" | bc)" -eq 1 ]; then
    verdict="took ${el}s, more than 2 x LOOM_TIMEOUT_S=$timeout_s"
  fi
  if [ -n "$verdict" ]; then
    echo "FAIL ($verdict): LOOM_TIMEOUT_S=$timeout_s $loom ${args[*]}"
    cat "$work/err"
    fail=$((fail + 1))
  fi
done
echo "fault soak: $runs runs in ${seconds}s: $ok_runs correct, $err_runs ended with one error" \
     "line, $fail bad"
[ "$fail" -eq 0 ] && [ "$runs" -ge 10 ]
