#!/usr/bin/env bash
# `loom attn` end to end: the acceptance runs of the foundation and context-parallel issues, and
# one clear error line with a non-zero exit for each kind of bad input.
# Usage: cli_checks.sh LOOM_BINARY
set -uo pipefail
loom="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
pass=0
fail=0
ok() { echo "ok   $1"; pass=$((pass + 1)); }
bad() { echo "FAIL $1"; fail=$((fail + 1)); }

# expect_ok NAME ARGS...: exit 0 and a passed check
expect_ok() {
  local name="$1"; shift
  if "$loom" attn "$@" > "$work/out" 2>&1 && grep -q "check     passed" "$work/out"; then
    ok "$name"
  else
    cat "$work/out"; bad "$name"
  fi
}

# expect_error NAME NEEDLE ARGS...: exit code 1, exactly one line on stderr containing NEEDLE
expect_error() {
  local name="$1" needle="$2"; shift 2
  "$loom" attn "$@" > "$work/stdout" 2> "$work/stderr"
  local rc=$?
  local lines
  lines=$(wc -l < "$work/stderr")
  if [ "$rc" -ne 0 ] && [ "$lines" -eq 1 ] && grep -qF -- "$needle" "$work/stderr"; then
    ok "$name: $(cat "$work/stderr")"
  else
    echo "  rc=$rc stderr lines=$lines:"; cat "$work/stderr"; bad "$name"
  fi
}

expect_ok "foundation: one rank, GQA, window, backward" \
  --seq 300 --heads 4 --kv-heads 2 --head-dim 48 --window 50 --backward --check
for s in ring ulysses allgather; do
  expect_ok "4 ranks $s zigzag" --ranks 4 --strategy $s --layout zigzag --seq 2048 --heads 8 \
    --kv-heads 2 --head-dim 64 --backward --check --iters 1 --warmup 0
  [ "$s" = ring ] && cp "$work/out" "$work/ring_out"
done
expect_ok "4 ranks hybrid 2x2 zigzag" --ranks 4 --strategy hybrid --ulysses 2 --layout zigzag \
  --seq 2048 --heads 8 --kv-heads 2 --head-dim 64 --backward --check --iters 1 --warmup 0
# zigzag ring: every rank the same per-step forward tiles
if awk '/^  [0-9]+ /{ s=""; for (i = 9; i <= NF; i++) s = s " " $i; print s }' "$work/ring_out" \
    | sort -u | wc -l | grep -qx 1; then
  ok "zigzag ring: equal per-step tile counts on every rank"
else
  cat "$work/ring_out"; bad "zigzag ring: equal per-step tile counts on every rank"
fi

# Bad input: one clear line, non-zero exit.
expect_error "unknown strategy" "unknown strategy 'tree'" --strategy tree --seq 64
expect_error "unknown layout" "unknown layout 'spiral'" --layout spiral --seq 64
expect_error "heads not multiple of kv-heads" "--heads 6 must be a multiple of --kv-heads 4" \
  --seq 64 --heads 6 --kv-heads 4
expect_error "docs do not sum" "--docs lengths sum to 30 but the sequence has 64 tokens" \
  --seq 64 --docs 10,20
expect_error "docs malformed" "is not a positive integer" --seq 64 --docs 10,x
expect_error "negative window" "--window must be >= 0" --seq 64 --window -3
expect_error "head dim too large" "--head-dim must be in [1, 256]" --seq 64 --head-dim 300
expect_error "ulysses heads" "heads (6) must be divisible by the ulysses degree (4)" \
  --ranks 4 --strategy ulysses --seq 64 --heads 6 --kv-heads 6
expect_error "ulysses kv heads" "kv-heads (3) and the ulysses degree (4) must divide one another" \
  --ranks 4 --strategy ulysses --seq 64 --heads 12 --kv-heads 3
expect_error "hybrid needs --ulysses" "needs --ulysses" --ranks 4 --strategy hybrid --seq 64
expect_error "hybrid degree" "--ulysses 3 must divide the number of ranks 4" \
  --ranks 4 --strategy hybrid --ulysses 3 --seq 64 --heads 12 --kv-heads 12
expect_error "--ulysses without hybrid" "--ulysses is only for --strategy hybrid" --ulysses 2
expect_error "missing input dir" "is not a directory" --input "$work/nope"
mkdir -p "$work/in"
expect_error "missing q.npy" "q.npy: cannot open" --input "$work/in"
printf 'garbage' > "$work/in/q.npy"
expect_error "garbage q.npy" "not a .npy file" --input "$work/in"
expect_error "input with shape options" "do not also give --seq" --input "$work/in" --seq 10
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
