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
expect_ok "bf16 storage, ring" --ranks 4 --seq 512 --heads 4 --kv-heads 2 --head-dim 64 \
  --backward --check --dtype bf16 --iters 1 --warmup 0 --quiet
expect_ok "bf16 storage, hybrid, documents" --ranks 4 --strategy hybrid --ulysses 2 --seq 300 \
  --heads 4 --kv-heads 2 --head-dim 32 --docs 100,200 --backward --check --dtype bf16 --iters 1 \
  --warmup 0 --quiet
expect_error "unknown dtype" "unknown --dtype 'fp16' (choose fp32 or bf16)" --dtype fp16
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

# Reports: JSON keys, one trace track (process) per rank, an SVG with a row per rank.
if "$loom" attn --ranks 4 --strategy ring --layout zigzag --seq 512 --heads 4 --kv-heads 2 \
    --head-dim 32 --backward --check --iters 2 --warmup 1 --quiet --baseline \
    --json "$work/r.json" --trace "$work/t.json" --timeline "$work/t.svg" > "$work/out" 2>&1 &&
   /usr/bin/python3 - "$work/r.json" "$work/t.json" "$work/t.svg" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for k in ["config", "forward_s", "backward_s", "gflops", "efficiency", "balance", "overlap",
          "ranks", "check"]:
    assert k in r, k
assert r["config"]["strategy"] == "ring" and r["config"]["seq"] == 512
assert r["forward_s"] > 0 and r["backward_s"] > 0 and r["gflops"] > 0
assert r["efficiency"] is not None and r["efficiency"] > 0
assert 1.0 <= r["balance"] < 2.0 and 0.0 <= r["overlap"] <= 1.0
assert len(r["ranks"]) == 4
for i, k in enumerate(r["ranks"]):
    assert k["rank"] == i
    for key in ["compute_s", "comm_s", "wait_s", "bytes_sent", "bytes_recv", "tiles",
                "peak_rss_bytes"]:
        assert key in k, key
    assert k["bytes_sent"] > 0 and k["tiles"] > 0 and k["peak_rss_bytes"] > 0
assert r["check"]["passed"] is True and r["check"]["max_rel_err"] < 1e-5
t = json.load(open(sys.argv[2]))
ev = t["traceEvents"]
assert {e["pid"] for e in ev} == {0, 1, 2, 3}
kinds = {e.get("cat") for e in ev if e["ph"] == "X"}
assert {"compute", "send", "recv", "wait"} <= kinds, kinds
svg = open(sys.argv[3]).read()
assert svg.startswith("<svg") and svg.count(">rank ") == 4 and "waiting" in svg
PY
then ok "json, trace and timeline"; else cat "$work/out"; bad "json, trace and timeline"; fi
r=$("$loom" attn --seq 64 --json "$work/r1.json" --quiet > /dev/null 2>&1 &&
    /usr/bin/python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['backward_s'], r['efficiency'], r['check'])" "$work/r1.json")
[ "$r" = "None None None" ] && ok "json nulls without --backward, --baseline, --check" || bad "json nulls: $r"

# Faults: a killed rank ends the run at once, a lost message within the timeout, a slow link
# changes nothing but the time. Never a hang: `timeout` would kill it (exit 124).
start=$(date +%s)
LOOM_TIMEOUT_S=10 timeout 60 "$loom" attn --ranks 4 --seq 2048 --backward --quiet \
  --fault kill:1 --output "$work/killed" > "$work/stdout" 2> "$work/stderr"
rc=$?
el=$(( $(date +%s) - start ))
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $el -le 30 ] && [ "$(wc -l < "$work/stderr")" -eq 1 ] &&
   grep -q "rank 1" "$work/stderr" && [ ! -e "$work/killed/out.npy" ]; then
  ok "kill:1 exits $rc in ${el}s: $(cat "$work/stderr")"
else
  cat "$work/stderr"; bad "kill:1 (rc=$rc, ${el}s)"
fi
start=$(date +%s)
LOOM_TIMEOUT_S=2 timeout 60 "$loom" attn --ranks 3 --seq 512 --quiet --fault drop:2,at=5 \
  > "$work/stdout" 2> "$work/stderr"
rc=$?
el=$(( $(date +%s) - start ))
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $el -le 6 ] && grep -q "dropped a message from world rank 2" "$work/stderr" &&
   grep -q "timed out" "$work/stderr"; then
  ok "drop:2 exits $rc in ${el}s: $(cat "$work/stderr")"
else
  cat "$work/stderr"; bad "drop:2 (rc=$rc, ${el}s)"
fi
expect_ok "delay:1:20 still exact" --ranks 4 --seq 512 --backward --check --fault delay:1:20 \
  --iters 1 --warmup 0 --quiet
LOOM_PROGRESS_AFTER_S=0 "$loom" attn --ranks 2 --seq 256 --iters 2 > /dev/null 2> "$work/stderr"
grep -q "iteration 1/3, .* s elapsed, about .* s left" "$work/stderr" && ok "progress on stderr" ||
  { cat "$work/stderr"; bad "progress on stderr"; }
LOOM_PROGRESS_AFTER_S=0 "$loom" attn --ranks 2 --seq 256 --iters 2 --quiet > /dev/null 2> "$work/stderr"
[ ! -s "$work/stderr" ] && ok "--quiet: nothing on stderr" || bad "--quiet: $(cat "$work/stderr")"
expect_error "bad fault" "fault" --ranks 2 --fault explode:1
expect_error "fault rank out of range" "names a rank outside" --ranks 2 --fault kill:5

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
