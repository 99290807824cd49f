#!/usr/bin/env bash
# `loom plan`: bad input gets one clear error line and a non-zero exit, never a hang, a silently
# ignored option or a replaced input file.
# Usage: plan_checks.sh LOOM_BINARY PROFILE_DIR
set -uo pipefail
loom="$1"
profiles="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/checks.sh"

expect_error() { expect_error_of plan "$@"; }
h100="$profiles/h100_sxm.json"

# A profile is read like every other input: a FIFO or a device is refused at once (a FIFO
# blocked forever, /dev/zero read until memory ran out), a directory named as one.
mkfifo "$work/fifo.json"
timeout 20 "$loom" plan --profile "$work/fifo.json" > "$work/stdout" 2> "$work/stderr"
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$(wc -l < "$work/stderr")" -eq 1 ] &&
  grep -qF "fifo.json: is not a regular file" "$work/stderr" &&
  ok "FIFO as --profile refused at once: $(cat "$work/stderr")" ||
  { cat "$work/stderr"; bad "FIFO as --profile (rc=$rc; 124: it blocked)"; }
timeout 20 "$loom" plan --profile /dev/zero > "$work/stdout" 2> "$work/stderr"
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -qF "/dev/zero: is not a regular file" "$work/stderr" &&
  ok "/dev/zero as --profile refused at once" ||
  { cat "$work/stderr"; bad "/dev/zero as --profile (rc=$rc; 124: it read forever)"; }
# "-" is standard input to InputFile, where a pipe that never closes blocked for ever: a profile
# is a regular file, "-" refused as not one (it was read, even from a regular file redirected).
expect_error "--profile -" "cannot read profile -: is not a regular file ('-' is standard input)" \
  --profile - < "$h100"
expect_error "directory as --profile" "is a directory" --profile "$work"
expect_error "missing --profile" "cannot read profile $work/none.json" --profile "$work/none.json"
# A shipped profile by its name (the installed loom finds it in share/loom/profiles/, this build's
# in the source tree: cmake/install_check.cmake tests the former); a file of that name in the
# working directory still wins, and an unknown name lists the shipped ones.
for name in h100_sxm h200.json; do
  (cd "$work" && "$loom" plan --simulate --profile "$name" --strategy ring --ranks 2 --seq 4096 \
    --heads 2 > "$work/named.txt" 2>&1) && grep -q "predicted forward" "$work/named.txt" &&
    ok "--profile $name: the shipped profile" || { cat "$work/named.txt"; bad "--profile $name"; }
done
printf '{}' > "$work/h100_sxm"
(cd "$work" && "$loom" plan --profile h100_sxm > "$work/named.txt" 2>&1)
grep -qF "loom: error: h100_sxm: missing field 'device.flops_bf16'" "$work/named.txt" &&
  ok "a file named h100_sxm in the working directory is read first" ||
  { cat "$work/named.txt"; bad "--profile h100_sxm with such a file here"; }
rm -f "$work/h100_sxm"
expect_error "unknown profile name" \
  "cannot read profile no_such_gpu: no such file, and no shipped profile no_such_gpu.json in " \
  --profile no_such_gpu
expect_error "unknown profile name lists the shipped ones" \
  "(the shipped profiles: a100_80gb, cpu_epyc7763_node, h100_sxm, h200)" --profile no_such_gpu

# One mode per run: the others' options were silently ignored.
expect_error "--simulate with --train-step" "separate modes" --simulate --train-step \
  --mesh 1,1,1,1 --profile "$h100"
expect_error "--simulate with --calibrate" "separate modes" --simulate --calibrate \
  "$work/p.json" --profile "$h100"
[ ! -e "$work/p.json" ] && ok "nothing calibrated or written" || bad "--calibrate ran"

# Out-of-range values are refused, not replaced by a default.
expect_error "--top 0" "--top must be >= 1, got 0" --profile "$h100" --top 0
expect_error "--top -3" "--top must be >= 1, got -3" --profile "$h100" --top -3
expect_error "--memory-limit -5" "--memory-limit must be a positive number of GB" \
  --profile "$h100" --memory-limit -5
expect_error "--memory-limit nan" "--memory-limit must be a positive number of GB" \
  --profile "$h100" --memory-limit nan
# The refused value as given (6 digits printed 1.0000001e6 as "1e+06", the limit itself).
expect_error "--memory-limit just above the largest" "at most 1e+06 (a profile's largest memory), got 1000000.1" \
  --profile "$h100" --memory-limit 1.0000001e6

# Outputs never replace the profile read, nor each other.
cp "$h100" "$work/mine.json"
before=$(md5sum < "$work/mine.json")
expect_error "--json onto the profile" "name the same file" --profile "$work/mine.json" \
  --json "$work/mine.json"
[ "$(md5sum < "$work/mine.json")" = "$before" ] && ok "the profile is unchanged" ||
  bad "the profile was replaced"
expect_error "--json and --svg on one path" "name the same file" --profile "$h100" \
  --json "$work/r" --svg "$work/r"
[ ! -e "$work/r" ] && ok "nothing written" || bad "an output was written"

# Unwritable outputs are refused before the search (or the calibration, or the measurement).
expect_error "--svg into a missing directory" "--svg $work/nodir/p.svg: cannot write into" \
  --profile "$h100" --svg "$work/nodir/p.svg"
[ ! -s "$work/stdout" ] && ok "refused before the search: no table" || bad "the search ran"
expect_error "--calibrate into a missing directory" "cannot write into" \
  --calibrate "$work/nodir/p.json"

# A failed run leaves no new output: with --json a.json --svg /dev/full the JSON was written, then
# the SVG failed (exit 1). Outputs written in place (a device, standard output) go first, the
# regular files are staged and renamed only once all are written.
"$loom" plan --profile "$h100" --top 2 --json "$work/a.json" --svg /dev/full > /dev/null \
  2> "$work/stderr"
rc=$?
[ $rc -eq 1 ] && grep -qF "/dev/full: write failed" "$work/stderr" && [ ! -e "$work/a.json" ] &&
  ok "--json a.json --svg /dev/full: exit 1, a.json not written" ||
  { cat "$work/stderr"; ls "$work"; bad "--svg /dev/full left --json written (rc=$rc)"; }
echo old > "$work/a.json"
"$loom" plan --profile "$h100" --top 2 --svg "$work/a.svg" --json /dev/full > /dev/null 2>&1
[ $? -eq 1 ] && [ "$(cat "$work/a.json")" = old ] && [ ! -e "$work/a.svg" ] &&
  ok "--svg a.svg --json /dev/full: exit 1, a.svg not written" || bad "--json /dev/full wrote --svg"
chmod 600 "$work/a.json"
# A killed run's staged files ("a.json.tmp.PID-s0") are removed by the next run (they were left
# for ever: only a lone output's write removed its target's stale temporaries).
sh -c 'exit 0' & wait $!
dead=$!
echo partial > "$work/a.json.tmp.$dead-s0"
echo partial > "$work/a.svg.tmp.$dead-s1"
if "$loom" plan --profile "$h100" --top 2 --json "$work/a.json" --svg "$work/a.svg" > /dev/null &&
   [ "$(stat -c %a "$work/a.json")" = 600 ] && [ -s "$work/a.svg" ] &&
   /usr/bin/python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$work/a.json" &&
   [ -z "$(find "$work" -name 'a.*.tmp.*')" ]; then
  ok "--json and --svg both written, a.json keeps its 0600, stale and new temporaries gone"
else ls -la "$work"; bad "--json and --svg together"; fi
rm -f "$work/a.json" "$work/a.svg"

# The text report on a full standard output is an error, exit 1 as in loom attn (docs/cli.md).
"$loom" plan --profile "$h100" --top 2 > /dev/full 2> "$work/stderr"
rc=$?
[ $rc -eq 1 ] && grep -qF "standard output: write failed" "$work/stderr" &&
  ok "plan > /dev/full: exit 1" || { cat "$work/stderr"; bad "plan > /dev/full (rc=$rc)"; }
# ... and a failed run leaves its files as they were: --json was replaced before the failed
# standard output was found. One error line.
echo old > "$work/a.json"
"$loom" plan --profile "$h100" --top 2 --json "$work/a.json" --svg "$work/a.svg" > /dev/full \
  2> "$work/stderr"
rc=$?
[ $rc -eq 1 ] && [ "$(cat "$work/a.json")" = old ] && [ ! -e "$work/a.svg" ] &&
  [ "$(grep -c . "$work/stderr")" = 1 ] && ok "plan --json a.json > /dev/full: a.json kept" ||
  { cat "$work/stderr"; bad "plan > /dev/full replaced --json or wrote --svg (rc=$rc)"; }
rm -f "$work/a.json" "$work/a.svg"

# main's usage errors name what is wrong, exit 2: an unknown command or option read "A subcommand
# is required", and `loom run --help` printed the top-level help with exit 0.
expect_usage() {  # expect_usage NAME NEEDLE ARGS...: exit 2, one stderr line with NEEDLE, no stdout
  local name="$1" needle="$2"; shift 2
  "$loom" "$@" > "$work/stdout" 2> "$work/stderr"
  local rc=$?
  if [ $rc -eq 2 ] && [ "$(wc -l < "$work/stderr")" -eq 1 ] && [ ! -s "$work/stdout" ] &&
     grep -qF -- "$needle" "$work/stderr"; then
    ok "$name: $(cat "$work/stderr")"
  else
    echo "  rc=$rc:"; cat "$work/stderr"; head -3 "$work/stdout"; bad "$name"
  fi
}
expect_usage "loom run" "unknown command 'run'; choose attn, train, plan or verify" run
expect_usage "loom atn --seq 8" "unknown command 'atn'; choose attn" atn --seq 8
expect_usage "loom run --help" "unknown command 'run'" run --help
expect_usage "loom --bogus" "unknown option '--bogus': before the command" --bogus
expect_usage "loom --bogus plan" "unknown option '--bogus'" --bogus plan
expect_usage "loom" "A subcommand is required"
"$loom" plan --help > "$work/stdout" 2>&1 && grep -q "Usage: .*loom plan" "$work/stdout" &&
  "$loom" --version > /dev/null && "$loom" --help > /dev/null &&
  ok "loom plan --help, loom --help and loom --version: exit 0" || bad "help and version"

# Sizes: the search's divisor loop wrapped past INT_MAX and divided by zero (SIGFPE); the
# simulator ran for minutes to centuries (--seq 1e12, 2^63 - 1) or until memory ran out
# (--ranks 100000) instead of refusing.
timeout 60 "$loom" plan --profile "$h100" --devices 2147483647 > "$work/stdout" 2> "$work/stderr"
rc=$?
[ $rc -eq 1 ] && grep -q "no configuration fits" "$work/stdout" &&
  ok "--devices 2147483647: searched, nothing fits (exit 1)" ||
  { cat "$work/stderr"; bad "--devices 2147483647 (rc=$rc)"; }
# Context-parallel degrees that leave a rank under one 128-token work tile are rejected with the
# reason, unsimulated (their O(cp^2) simulations made --devices 4096 take 118 s at S = 128K).
"$loom" plan --profile "$h100" --devices 1024 --seq 8192 --json "$work/tiles.json" > /dev/null 2>&1
if /usr/bin/python3 - "$work/tiles.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert max(c["ring"] * c["ulysses"] for c in r["ranked"]) == 64, "cp 64 (128 tokens) is the largest"
why = [c["why_not"] for c in r["rejected"]]
assert "cp 128 leaves 64 tokens per rank, under one 128-token work tile" in why, why[:5]
PY
then ok "--seq 8192 --devices 1024: cp above 64 rejected (under one work tile per rank)"
else bad "--seq 8192 --devices 1024: cp above 64 rejected (under one work tile per rank)"
fi
for args in "--seq 1000000000000" "--seq 9223372036854775807" "--ranks 100000 --seq 1000000"; do
  start=$(date +%s)
  # shellcheck disable=SC2086
  timeout 30 "$loom" plan --simulate --profile "$h100" $args > "$work/stdout" 2> "$work/stderr"
  rc=$?
  [ $rc -eq 1 ] && grep -q "too large to simulate" "$work/stderr" &&
    [ $(( $(date +%s) - start )) -le 10 ] && ok "--simulate $args: $(cat "$work/stderr")" ||
    { cat "$work/stderr"; bad "--simulate $args (rc=$rc; 124: still running after 30 s)"; }
done
# --train-step measures one real rank of loom train: it had no memory estimate (--seq 1e9 ran on
# past 3.8 GB); it now refuses as loom train does.
cpu="$profiles/cpu_epyc7763_node.json"
start=$(date +%s)
timeout 60 "$loom" plan --train-step --profile "$cpu" --mesh 1,1,1,1 --seq 1000000000 \
  > "$work/stdout" 2> "$work/stderr"
rc=$?
[ $rc -eq 1 ] && grep -q "one measured rank of the model) needs about" "$work/stderr" &&
  [ $(( $(date +%s) - start )) -le 10 ] && ok "--train-step --seq 1e9: $(cat "$work/stderr")" ||
  { cat "$work/stderr"; bad "--train-step --seq 1e9 (rc=$rc; 124: still running after 60 s)"; }
expect_error "--train-step --memory-limit" "(--memory-limit); make the problem smaller" \
  --train-step --profile "$cpu" --mesh 1,1,1,1 --memory-limit 0.001
# --inner is ring2d's, in --train-step as in loom train (with ring it was ignored).
expect_error "--train-step --inner with ring" "--inner is only for --strategy ring2d (mesh '1,1,1,2' runs ring)" \
  --train-step --profile "$cpu" --mesh 1,1,1,2 --inner 2
expect_error "--train-step ring2d without --inner" "--strategy ring2d needs --inner N" \
  --train-step --profile "$cpu" --mesh 1,1,1,2 --strategy ring2d
# A long sequence below the limit is still simulated.
"$loom" plan --simulate --profile "$h100" --seq 1000000000 --ranks 8 > "$work/stdout" 2>&1 &&
  grep -q "predicted forward" "$work/stdout" && ok "--simulate --seq 1e9 on 8 ranks" ||
  { cat "$work/stdout"; bad "--simulate --seq 1e9"; }

# With an output on "-" (standard output) the text stays off it, as in loom attn: `--json -`
# mixed the table and the JSON (docs/cli.md, "Files").
json_only() {  # json_only NAME ARGS...: stdout is one JSON document and nothing else
  local name="$1"; shift
  if "$loom" plan "$@" > "$work/stdout" 2> "$work/stderr" &&
     /usr/bin/python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$work/stdout"; then
    ok "$name: standard output holds the JSON alone"
  else
    head -c 300 "$work/stdout"; cat "$work/stderr"; bad "$name: text mixed into the JSON"
  fi
}
json_only "search --json -" --profile "$h100" --top 2 --json -
json_only "search --json - --explain" --profile "$h100" --top 2 --explain --json - \
  --svg "$work/s.svg"
json_only "--simulate --json -" --simulate --profile "$h100" --ranks 4 --seq 8192 --json -
# --simulate's JSON is written rank by rank (one document of 8192 ranks' step counts took 3.6 GB):
# every rank's fields, its per-step forward tiles summing to its forward tiles, as the table says.
if "$loom" plan --simulate --profile "$h100" --ranks 16 --seq 65536 --json "$work/sim.json" \
     > "$work/stdout" 2> "$work/stderr" && /usr/bin/python3 - "$work/sim.json" "$work/stdout" <<'PY'
import json, re, sys
j = json.load(open(sys.argv[1]))
assert set(j) == {"forward_s", "backward_s", "balance", "ranks"}, list(j)
assert j["forward_s"] > 0 and j["backward_s"] > 0 and 0 < j["balance"] <= 1.0001, j
table = {int(m[0]): int(m[1]) for m in re.findall(r"^  (\d+) +(\d+) ", open(sys.argv[2]).read(), re.M)}
assert len(j["ranks"]) == 16 and len(table) == 16, (len(j["ranks"]), table)
keys = {"rank", "forward_tiles", "tiles", "full_tiles", "partial_tiles", "step_tiles", "bytes_sent",
        "bytes_recv", "peak_buffer_bytes", "gathered_bytes", "compute_s", "exposed_comm_s", "idle_s",
        "exposed_by_kind"}
for i, r in enumerate(j["ranks"]):
    assert set(r) == keys and r["rank"] == i, r
    assert len(r["step_tiles"]) == 16 and sum(r["step_tiles"]) == r["forward_tiles"] == table[i], r
PY
then ok "--simulate --json: every rank, its step tiles summing to the table's forward tiles"
else cat "$work/stderr"; bad "--simulate --json content"; fi
json_only "--train-step --json -" --train-step --profile "$profiles/cpu_epyc7763_node.json" \
  --model 1,32,2,2,64,256 --seq 64 --batch 2 --measure-steps 1 --mesh 1,1,1,2 --json -
"$loom" plan --profile "$h100" --top 2 --svg - > "$work/stdout" 2> "$work/stderr"
[ "$(head -c 4 "$work/stdout")" = "<svg" ] && [ "$(tail -n 1 "$work/stdout")" = "</svg>" ] &&
  ok "search --svg -: standard output holds the SVG alone" ||
  { head -c 300 "$work/stdout"; bad "search --svg -: text mixed into the SVG"; }

# --threads and --ranks-per-node are bounded, and checked before the banner: --threads
# 2147483647 ended in libgomp's fatal error, --ranks-per-node 100000 grew past 1400 threads and
# 4 GB, and --threads 0 printed the banner before its error.
for t in 0 2147483647; do
  expect_error "--calibrate --threads $t" "--threads must be in [1, 1024], got $t" \
    --calibrate "$work/c.json" --threads "$t"
  expect_error "--train-step --threads $t" "--threads must be in [1, 1024], got $t" \
    --train-step --profile "$cpu" --mesh 1,1,1,1 --threads "$t"
done
for r in 0 100000; do
  start=$(date +%s)
  timeout 60 "$loom" plan --calibrate "$work/c.json" --ranks-per-node "$r" > "$work/stdout" \
    2> "$work/stderr"
  rc=$?
  [ $rc -eq 1 ] && [ "$(wc -l < "$work/stderr")" -eq 1 ] &&
    grep -qF -- "--ranks-per-node must be in [1, 1024]" "$work/stderr" &&
    [ $(( $(date +%s) - start )) -le 10 ] && ok "--ranks-per-node $r: $(cat "$work/stderr")" ||
    { cat "$work/stderr"; bad "--ranks-per-node $r (rc=$rc; 124: still running after 60 s)"; }
done
[ ! -e "$work/c.json" ] && ok "nothing calibrated" || bad "a profile was written"

# Messages that name the real limit.
expect_error "--mesh 2^31 - 1" "'2147483647' is not an integer in [1, 1048576]" \
  --train-step --profile "$cpu" --mesh 1,1,1,2147483647
expect_error "--mesh world" "--mesh '1024,1024,1,2' is a world of 2097152 ranks, at most 1048576" \
  --train-step --profile "$cpu" --mesh 1024,1024,1,2
expect_error "--memory-limit 1e300" "at most 1e+06 (a profile's largest memory), got 1e+300" \
  --profile "$h100" --memory-limit 1e300
expect_error "--ulysses 0" "--ulysses: must be an integer >= 1, got 0" --simulate \
  --profile "$h100" --strategy hybrid --ulysses 0 --ranks 4
expect_error "--inner 0" "--inner: must be an integer >= 1, got 0" --simulate \
  --profile "$h100" --strategy ring2d --inner 0 --ranks 4

# A long search says how far it is on stderr (720720 devices searched for minutes without a
# word): lines every LOOM_PLAN_PROGRESS_S seconds, rising; none with 0; the ranking unchanged.
if LOOM_PLAN_PROGRESS_S=0.001 "$loom" plan --profile "$h100" --devices 48 --seq 16384 \
     > "$work/p1" 2> "$work/p1.err" &&
   LOOM_PLAN_PROGRESS_S=0 "$loom" plan --profile "$h100" --devices 48 --seq 16384 \
     > "$work/p0" 2> "$work/p0.err" && [ ! -s "$work/p0.err" ] &&
   diff <(grep -v "planned in" "$work/p0") <(grep -v "planned in" "$work/p1") > /dev/null &&
   /usr/bin/python3 - "$work/p1.err" <<'PY'
import re, sys
lines = open(sys.argv[1]).read().splitlines()
done = [float(re.match(r"loom plan: searching, ([0-9]+) % done after [0-9]+ s", l).group(1))
        for l in lines]
assert len(done) >= 3 and done == sorted(done) and done[-1] < 100, lines
PY
then ok "progress lines on stderr, rising; none with LOOM_PLAN_PROGRESS_S=0"
else cat "$work/p1.err" "$work/p0.err"; bad "progress lines"; fi
LOOM_PLAN_PROGRESS_S=-1 "$loom" plan --profile "$h100" > "$work/out" 2>&1
[ $? -eq 1 ] && grep -q "LOOM_PLAN_PROGRESS_S must be a decimal number of seconds from 0 to 1e9, got '-1'" "$work/out" &&
  ok "LOOM_PLAN_PROGRESS_S=-1 refused" || { cat "$work/out"; bad "LOOM_PLAN_PROGRESS_S=-1"; }

# The same run with valid options still works.
if "$loom" plan --profile "$h100" --top 2 --memory-limit 80 --json "$work/r.json" \
     --svg "$work/r.svg" > "$work/out" 2>&1 && [ -s "$work/r.json" ] && [ -s "$work/r.svg" ]; then
  ok "valid run writes --json and --svg"
else
  cat "$work/out"; bad "valid run"
fi

# Times of a tiny problem in a unit that shows them: a 41 us step read "0.000" in every time
# column and "0.000 s per step" in --explain, and a winner without a cp group printed an empty
# "by kind:" line.
if "$loom" plan --profile "$profiles/a100_80gb.json" --model 1,64,4,2,256,256 --seq 64 \
     --devices 2 --top 3 --explain > "$work/out" 2>&1 &&
   grep -q "step us" "$work/out" && grep -q "by kind: none (no cp group)" "$work/out" &&
   grep -qE "[1-9][0-9.]* us per step" "$work/out" && ! grep -q " 0\.000 s per step" "$work/out" &&
   /usr/bin/python3 - "$work/out" <<'PY'
import re, sys
rows = [l for l in open(sys.argv[1]) if re.match(r"  [0-9]+ +dp", l)]
steps = [float(next(t for t in l.split() if "." in t and "/" not in t)) for l in rows]
assert len(steps) == 3 and all(x > 1 for x in steps), (rows, steps)  # the step column, in us
PY
then ok "tiny problem: the table in us, --explain's durations with units"
else cat "$work/out"; bad "tiny problem's units"; fi

# Stripe shards interleave, so every pair's tile count looped over its q-tiles: P x S / block_q
# steps (S = 2^28 on 8192 ranks ran for hours, 2048 ranks for minutes, and a search over 1024
# devices took 29-32 s). Each distinct loop now runs once: 0.25 s and 1-3 s here.
timeout 30 "$loom" plan --simulate --profile "$h100" --heads 1 --head-dim 1 --layout stripe \
  --ranks 2048 --seq 268435456 --forward-only > "$work/stdout" 2>&1
rc=$?
[ $rc -eq 0 ] && grep -q "predicted forward" "$work/stdout" &&
  ok "stripe over 2048 ranks, S = 2^28, simulated" ||
  { tail -3 "$work/stdout"; bad "stripe over 2048 ranks (rc=$rc; 124: over 30 s)"; }
timeout 20 "$loom" plan --profile "$h100" --model 2,256,8,8,0,256 --seq 268435456 \
  --devices 1024 --strategies ring --top 1 > "$work/stdout" 2>&1
rc=$?
[ $rc -eq 0 ] && grep -q "candidates ranked" "$work/stdout" &&
  ok "every layout searched over 1024 devices, S = 2^28" ||
  { tail -3 "$work/stdout"; bad "search over 1024 devices at S = 2^28 (rc=$rc; 124: over 20 s)"; }

# --simulate reports the tensors Ulysses and hybrid gather outside the memory seam
# (gathered_bytes, which the planner's memory counts), in the table and in --json; the ring
# gathers none. Ulysses over 2 ranks, S = 4096, 2 heads, D 64, fp32, backward: each rank's
# group holds all 4096 rows of its one head: q, k, v, out (4 x 4096 x 64 x 4 B) and dout, dq,
# dk, dv (fp32) = 8 x 1 048 576 B.
for s in ulysses ring; do
  "$loom" plan --simulate --profile "$h100" --strategy $s --ranks 2 --seq 4096 --heads 2 \
    --json "$work/$s.json" > "$work/$s.txt" 2>&1 || bad "--simulate --strategy $s"
done
if grep -q " gathered$" "$work/ulysses.txt" &&
   /usr/bin/python3 - "$work/ulysses.json" "$work/ring.json" <<'PY'
import json, sys
u, r = (json.load(open(f)) for f in sys.argv[1:3])
assert [x["gathered_bytes"] for x in u["ranks"]] == [8 * 4096 * 64 * 4] * 2, u["ranks"][0]
assert [x["gathered_bytes"] for x in r["ranks"]] == [0, 0], r["ranks"][0]
PY
then ok "--simulate shows gathered_bytes (table and --json)"
else cat "$work/ulysses.txt"; bad "--simulate gathered_bytes"; fi

summary
