#!/usr/bin/env bash
# `loom plan`: bad profiles and bad options get one `loom: error:` line naming the problem and a
# non-zero exit, never a ranking or a simulation built on them (zero bandwidths read as free
# links, NaN and inf in the ranking, negative byte counters, options silently ignored).
# Usage: plan_input_checks.sh LOOM_BINARY PROFILE_DIR
set -uo pipefail
loom="$1"
profiles="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/../tools/checks.sh"

expect_error() { expect_error_of plan "$@"; }
h100="$profiles/h100_sxm.json"

# Profiles: each figure in its range, named with the file (`variant NAME PYTHON-EDIT`).
variant() {
  /usr/bin/python3 - "$h100" "$work/$1.json" "$2" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
exec(sys.argv[3])
json.dump(p, open(sys.argv[2], "w"))
PY
}
variant bw0 "p['links']['inter']['bandwidth'] = 0"
variant intra0 "p['links']['intra']['bandwidth'] = 0"
variant nolinks "del p['links']"
variant mem0 "p['device']['memory_bytes'] = 0"
variant bq_huge "p['device']['block_q'] = 1e18"
variant bq_frac "p['device']['block_q'] = 1.5"
variant eff0 "p['device']['attn_fwd_eff'] = 0"
expect_error "inter bandwidth 0 (simulate)" \
  "bw0.json: field 'links.inter.bandwidth' must be a number in [1000, 1e+15] (bytes/s), got 0" \
  --simulate --profile "$work/bw0.json" --ranks 16 --seq 8192 --heads 32 --kv-heads 8 \
  --head-dim 128 --dtype bf16
expect_error "inter bandwidth 0 (search)" "bw0.json: field 'links.inter.bandwidth'" \
  --profile "$work/bw0.json" --devices 16 --seq 8192
expect_error "intra bandwidth 0" "intra0.json: field 'links.intra.bandwidth'" \
  --profile "$work/intra0.json" --seq 8192
expect_error "no links" "nolinks.json: missing field 'links.intra.bandwidth'" \
  --profile "$work/nolinks.json" --seq 8192 --explain --json "$work/nolinks_rank.json"
[ ! -e "$work/nolinks_rank.json" ] && ok "no ranking written" || bad "a ranking was written"
expect_error "memory_bytes 0" "mem0.json: field 'device.memory_bytes' must be a number in (0" \
  --profile "$work/mem0.json" --seq 8192
expect_error "block_q 1e18" "field 'device.block_q' must be an integer in [1, 4096], got 1e+18" \
  --profile "$work/bq_huge.json" --seq 8192
expect_error "block_q 1.5" "field 'device.block_q' must be an integer in [1, 4096], got 1.5" \
  --profile "$work/bq_frac.json" --seq 8192
expect_error "attn_fwd_eff 0" "eff0.json: field 'device.attn_fwd_eff' must be a number in [0.001, 1]" \
  --profile "$work/eff0.json" --seq 8192
# Efficiencies (and a masked tile's cost) of 1e-300 passed "> 0": --simulate printed a 300-digit
# forward time with "backward 0.000 ms", or "inf ms" (1.5e307 s), and the search ranked a winner
# with a 7e297 s step and 0 tokens/s, exit 0. A thousandth is the least.
variant fwd_tiny "p['device']['attn_fwd_eff'] = 1e-300"
variant coll_tiny "p['collectives'] = {k: 1e-300 for k in p['collectives']}"
variant gemm_tiny "p['device']['gemm_eff'] = 1e-300"
variant partial_tiny "p['device']['partial_tile_cost'] = 1e-300"
expect_error "attn_fwd_eff 1e-300 (simulate)" \
  "fwd_tiny.json: field 'device.attn_fwd_eff' must be a number in [0.001, 1] (a fraction of peak), got 1e-300" \
  --simulate --profile "$work/fwd_tiny.json" --ranks 2 --seq 4096 --json "$work/fwd_tiny_sim.json"
[ ! -e "$work/fwd_tiny_sim.json" ] && ok "no simulation written" || bad "a simulation was written"
expect_error "collectives 1e-300 (simulate)" "coll_tiny.json: field 'collectives.a2a_eff' must be a number in [0.001, 1]" \
  --simulate --profile "$work/coll_tiny.json" --ranks 16 --seq 8192
expect_error "gemm_eff 1e-300 (search)" "gemm_tiny.json: field 'device.gemm_eff' must be a number in [0.001, 1]" \
  --profile "$work/gemm_tiny.json" --seq 8192 --devices 8
expect_error "partial_tile_cost 1e-300" \
  "partial_tiny.json: field 'device.partial_tile_cost' must be a number in [0.001, 100]" \
  --profile "$work/partial_tiny.json" --seq 8192
# Rates and bandwidths far below any machine: 1e-300 passed "> 0" and --simulate printed
# "predicted forward inf ms, backward -nan ms ... balance -nan", exit 0, with nulls in --json.
variant flops_tiny "p['device']['flops_bf16'] = 1e-300"
variant membw_tiny "p['device']['mem_bandwidth'] = 1e-300"
variant inter_tiny "p['links']['inter']['bandwidth'] = 1e-300"
expect_error "flops_bf16 1e-300" \
  "flops_tiny.json: field 'device.flops_bf16' must be a number in [1e+06, 1e+18] (FLOP/s)" \
  --simulate --profile "$work/flops_tiny.json" --ranks 2 --seq 4096 --dtype bf16 \
  --json "$work/tiny_sim.json"
[ ! -e "$work/tiny_sim.json" ] && ok "no simulation written" || bad "a simulation was written"
expect_error "mem_bandwidth 1e-300" "field 'device.mem_bandwidth' must be a number in [1000," \
  --simulate --profile "$work/membw_tiny.json" --ranks 2 --seq 4096 --dtype bf16
expect_error "inter bandwidth 1e-300" "field 'links.inter.bandwidth' must be a number in [1000," \
  --simulate --profile "$work/inter_tiny.json" --ranks 16 --seq 8192 --dtype bf16
# A profile loom plan --calibrate writes meets the same ranges (its memory_bytes was 0); written
# to standard output (--calibrate -), it is the JSON alone ("wrote the profile ... to -" followed
# it there).
if "$loom" plan --calibrate - --threads 1 --ranks-per-node 1 > "$work/cal.json" 2> /dev/null &&
   "$loom" plan --simulate --profile "$work/cal.json" --ranks 2 --seq 1024 > "$work/stdout" \
     2> "$work/stderr" && grep -q "predicted forward" "$work/stdout"; then
  ok "a calibrated profile, written to standard output, loads"
else
  tail -n 3 "$work/cal.json"; cat "$work/stderr"; bad "a calibrated profile loads"
fi

# Simulation sizes: no counter may wrap (--head-dim 2^63 - 1 printed "sent -16777216").
expect_error "--head-dim 2^63-1" "--head-dim must be in [1, 256], got 9223372036854775807" \
  --simulate --profile "$h100" --head-dim 9223372036854775807
expect_error "--heads 1e8" "too large to simulate: 100000000 heads" \
  --simulate --profile "$h100" --heads 100000000 --seq 100000000
expect_error "--kv-heads 0" "--kv-heads must be >= 1, got 0" --simulate --profile "$h100" \
  --kv-heads 0

# --simulate follows loom attn's rules for the strategy's options, and refuses the search's.
expect_error "ring --ulysses 2" "--ulysses is only for --strategy hybrid (got --strategy ring)" \
  --simulate --profile "$h100" --strategy ring --ulysses 2
expect_error "ring --inner 2" "--inner is only for --strategy ring2d (got --strategy ring)" \
  --simulate --profile "$h100" --strategy ring --inner 2
expect_error "hybrid without --ulysses" "--strategy hybrid needs --ulysses N" \
  --simulate --profile "$h100" --strategy hybrid --ranks 4
expect_error "hybrid heads rule" "heads (8) must be divisible by the ulysses degree (3)" \
  --simulate --profile "$h100" --strategy hybrid --ulysses 3 --ranks 6
expect_error "--simulate --model" "--model does not apply to --simulate" \
  --simulate --profile "$h100" --model foo
expect_error "--simulate --devices" "--devices does not apply to --simulate" \
  --simulate --profile "$h100" --devices 0
expect_error "--simulate --top" "--top does not apply to --simulate" \
  --simulate --profile "$h100" --top 0
expect_error "search --heads" "--heads does not apply to the search (it is an option of --simulate)" \
  --profile "$h100" --heads 4
expect_error "--calibrate --profile" "--profile does not apply to --calibrate" \
  --calibrate "$work/c.json" --profile "$h100"
expect_error "--simulate --docs" "--docs lengths sum to 4096 but the sequence has 8192 tokens" \
  --simulate --profile "$h100" --seq 8192 --docs 4096

# The search: what would make every candidate invalid is named up front.
expect_error "--window -1" "--window must be >= 0 (0 = no window), got -1" \
  --profile "$h100" --window -1 --seq 8192
expect_error "--docs 4096 --seq 8192" "--docs lengths sum to 4096 but the sequence has 8192" \
  --profile "$h100" --docs 4096 --seq 8192
expect_error "nothing fits" "no configuration fits: " --profile "$h100" --seq 8192 \
  --memory-limit 1
expect_error "head dim 512" "head dim (dim 4096 / 8 heads = 512) must be at most 256" \
  --profile "$h100" --model 2,4096,8,8,1024,256
# --seq 1: loom train refuses a sequence under 2 tokens, so a training plan does (it ranked dp and
# tp meshes loom train could not run); prefill plans it (dp and tp only), with finite figures.
expect_error "--seq 1 in training" \
  "--seq must be >= 2 to plan training (loom train's shortest sequence), got 1" \
  --profile "$h100" --seq 1
if "$loom" plan --profile "$h100" --seq 1 --mode prefill --json "$work/one.json" > "$work/stdout" \
     2> "$work/stderr" && /usr/bin/python3 - "$work/one.json" <<'PY'
import json, math, sys
r = json.load(open(sys.argv[1]))
assert r["ranked"], "nothing ranked"
for c in r["ranked"]:
    assert c["ring"] * c["ulysses"] == 1, c["name"]
    assert all(math.isfinite(c[k]) and c[k] > 0 for k in ("step_s", "tokens_per_s", "mfu")), c
PY
then ok "--seq 1 --mode prefill ranks dp/tp candidates"
else cat "$work/stderr"; bad "--seq 1"
fi
# tp divides the FFN size, loom train's rule: dp1 tp4 was ranked first with an FFN of 16386.
if "$loom" plan --profile "$h100" --model 8,4096,32,8,16386,256 --seq 128 --devices 4 \
     --memory-limit 16 --json "$work/ffn.json" > "$work/stdout" 2>&1 &&
   /usr/bin/python3 - "$work/ffn.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["ranked"] and all(16386 % c["tp"] == 0 for c in r["ranked"]), [c["name"] for c in r["ranked"]]
assert any(c["why_not"] == "tp 4 does not divide the FFN size 16386 (loom train's rule)"
           for c in r["rejected"]), r["rejected"]
PY
then ok "tp 4 not ranked with an FFN of 16386"
else cat "$work/stdout"; bad "tp not dividing the FFN"
fi
# --model's FFN 0 is 4 x dim, as loom train's --ffn 0 (it was refused).
"$loom" plan --profile "$h100" --model 2,128,4,2,0,256 --seq 8192 --top 1 > "$work/stdout" 2>&1 &&
  grep -q "ffn 512," "$work/stdout" && ok "--model ...,0,... is ffn 4 x dim" ||
  { cat "$work/stdout"; bad "--model ffn 0"; }
# A valid search never reports NaN or inf.
"$loom" plan --profile "$h100" --devices 16 --seq 8192 --explain --json "$work/r.json" \
  > "$work/stdout" 2>&1 && ! grep -qiE 'nan|inf' "$work/stdout" &&
  ! grep -qE 'NaN|Infinity|null' "$work/r.json" && ok "a valid search: finite figures" ||
  bad "a valid search: finite figures"

# A profile read strictly: a key given twice took its last value silently, and a NUL ended the
# text (what followed it was never read).
/usr/bin/python3 - "$h100" "$work" <<'PY'
import sys
s = open(sys.argv[1]).read()
open(sys.argv[2] + "/dup.json", "w").write(s.replace('"memory_bytes":', '"memory_bytes": 1e9, "memory_bytes":', 1))
open(sys.argv[2] + "/nul.json", "w").write(s + "\0 garbage {{{")
PY
expect_error "a key given twice" "dup.json: the key \"memory_bytes\" is given twice in one object" \
  --profile "$work/dup.json"
expect_error "a NUL byte" "nul.json: a NUL byte at offset" --profile "$work/nul.json"

# The search: a failed one writes nothing (--json was replaced by the failed ranking, --svg kept);
# --strategies named twice counts once (every row was listed twice); a mesh without a cp group is
# a candidate whatever --strategies names (--strategies ulysses on 1 device: "nothing to rank");
# with checkpointing the exposed communication by kind adds up to the total; and the kinds are
# the rank's that gives the total, so they sum to it (each kind's maximum over the ranks summed
# to more: hybrid with a ring of 3 or 6, 12 devices).
echo '{"old": 1}' > "$work/keep.json"; echo '<svg old/>' > "$work/keep.svg"
expect_error "a failed search" "no configuration" --profile "$h100" --devices 1 \
  --json "$work/keep.json" --svg "$work/keep.svg"
[ "$(cat "$work/keep.json")" = '{"old": 1}' ] && [ "$(cat "$work/keep.svg")" = '<svg old/>' ] &&
  ok "a failed search left --json and --svg alone" || bad "a failed search wrote an output"
"$loom" plan --profile "$h100" --strategies ring --json "$work/once.json" > /dev/null 2>&1
"$loom" plan --profile "$h100" --strategies ring,ring --json "$work/twice.json" > /dev/null 2>&1
"$loom" plan --profile "$h100" --devices 1 --model 2,1024,8,8,0,1000 --seq 4096 \
  --strategies ulysses --json "$work/one.json" > /dev/null 2>&1
"$loom" plan --profile "$h100" --devices 8 --model 2,1024,8,8,0,1000 --seq 4096 \
  --strategies ulysses --json "$work/u8.json" > /dev/null 2>&1
"$loom" plan --profile "$h100" --devices 8 --model 2,1024,8,8,0,1000 --seq 4096 \
  --json "$work/all8.json" > /dev/null 2>&1
"$loom" plan --profile "$h100" --devices 12 --model 2,1024,8,8,0,1000 --seq 4096 --top 1000 \
  --json "$work/all12.json" > /dev/null 2>&1
if /usr/bin/python3 - "$work" <<'PY'
import json, sys
w = sys.argv[1]
once, twice = (json.load(open(f"{w}/{n}.json")) for n in ("once", "twice"))
assert len(once["ranked"]) == len(twice["ranked"]) and len(once["rejected"]) == len(twice["rejected"]), \
    (len(once["ranked"]), len(twice["ranked"]))
one = json.load(open(f"{w}/one.json"))
assert [c["name"] for c in one["ranked"]][:1] == ["dp1 tp1 u1 r1 none/contiguous"], one["ranked"][:1]
u8, all8 = (json.load(open(f"{w}/{n}.json")) for n in ("u8", "all8"))
assert u8["ranked"][0]["strategy"] == "none", u8["ranked"][0]["name"]  # dp8: the best of all
assert u8["ranked"][0]["name"] == all8["ranked"][0]["name"], (u8["ranked"][0]["name"], all8["ranked"][0]["name"])
for c in once["ranked"]:
    kinds = c["exposed_by_kind"]
    if c["checkpoint"] and kinds and c["exposed_cp_comm_s"] > 0:
        assert abs(max(kinds.values()) - c["exposed_cp_comm_s"]) <= 1e-9 * c["exposed_cp_comm_s"], c
# A candidate rejected before simulating names its lower bound (memory_bytes was 0).
for c in json.load(open(f"{w}/all8.json"))["rejected"] + json.load(open(f"{w}/once.json"))["rejected"]:
    if "GB per device" in c["why_not"]:
        assert c["memory_bytes"] > 0, c
all12 = json.load(open(f"{w}/all12.json"))
assert any(c["strategy"] == "hybrid" for c in all12["ranked"]), "12 devices ranked no hybrid"
for c in all12["ranked"]:
    kinds, total = c["exposed_by_kind"], c["exposed_cp_comm_s"]
    assert abs(sum(kinds.values()) - total) <= 1e-9 * max(total, 1e-30), (c["name"], kinds, total)
PY
then ok "--strategies deduplicated, meshes without cp always candidates, kinds add up"
else bad "--strategies and the exposed communication by kind"; fi
# --measure-steps counts steps run here: 2^63 - 1 wrapped and was refused as a "--steps".
expect_error "--measure-steps 2^63 - 1" "--measure-steps must be in [1, 1000000]" --train-step \
  --profile "$profiles/cpu_epyc7763_node.json" --mesh 1,1,1,1 --model 1,64,2,1,0,256 --seq 64 \
  --batch 1 --measure-steps 9223372036854775807

# Packed documents: every pair of chunks was tried, though only chunks of one document meet (4000
# documents on 16 devices: 82 s, on 64 still running after 120 s). A guard against a hang, not a
# speed limit: it takes about half a second here.
docs=$(/usr/bin/python3 -c "n=4000;S=131072;l=[S//n]*n;l[-1]+=S-sum(l);print(','.join(map(str,l)))")
timeout 60 "$loom" plan --profile "$h100" --docs "$docs" --devices 16 --top 1 > "$work/stdout" 2>&1
rc=$?
[ $rc -eq 0 ] && grep -q "candidates ranked" "$work/stdout" &&
  ok "4000 documents on 16 devices planned in $(grep -o 'planned in [0-9.]* s' "$work/stdout" | cut -d' ' -f3) s" ||
  { tail -3 "$work/stdout"; bad "4000 documents on 16 devices (rc=$rc; 124: over 60 s)"; }

summary
