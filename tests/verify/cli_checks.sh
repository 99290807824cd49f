#!/bin/bash
# loom verify end to end: the defect library named from per-rank files, loom attn's own outputs
# passing in every strategy and layout (global, and per rank in every convention), layouts on
# disk, the JSON report and the heat map, and unusable input (exit status 2).
# Usage: cli_checks.sh LOOM MAKE_DEFECTS
set -u
LOOM=$1
MK=$2
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# expect RC PATTERN -- command...: exit status RC and output matching PATTERN.
expect() {
  local rc=$1 pat=$2
  shift 3
  local out got
  out=$("$@" 2>&1)
  got=$?
  if [ "$got" != "$rc" ]; then fail "exit $got (want $rc): $*"; echo "$out" | tail -5; return; fi
  if ! grep -q -- "$pat" <<<"$out"; then fail "no '$pat' in output of: $*"; echo "$out" | tail -5; fi
}

"$MK" "$T/lib" zigzag 4 96 || { echo "make_defects failed"; exit 1; }
V() { "$LOOM" verify --input "$T/lib/input" --convention zigzag --ranks 4 "$@"; }
expect 0 "verify    PASSED" -- V --candidate "$T/lib/correct"
expect 1 "rank 3's queries lack the contribution of KV chunks 1 and 6 (ring step 2" -- V --candidate "$T/lib/dropped_step"
expect 1 "every rank counted twice ring step 1" -- V --candidate "$T/lib/doubled_step"
expect 1 "the diagonal blocks are masked with the wrong offset" -- V --candidate "$T/lib/mask_offset"
expect 1 "wrong zigzag order" -- V --candidate "$T/lib/zigzag_order"
expect 1 "the error grows with ring step: partial results were rounded to bf16" -- V --candidate "$T/lib/bf16_steps"
expect 1 "missing log-sum-exp merge" -- V --candidate "$T/lib/no_lse_merge"
expect 1 "stale KV in the backward: at ring step 3" -- V --candidate "$T/lib/stale_kv"
# The forward's stale KV was "every rank skipped ring step 2" (half the error unexplained).
expect 1 "diagnosis stale KV in the forward: at ring step 2 every rank computed with the KV block of step 1" -- V --candidate "$T/lib/stale_kv_forward"
expect 1 "wrong softmax scale: the candidate used 0.0625 (= 1/D)" -- V --candidate "$T/lib/wrong_scale"
expect 1 "out has 1 non-finite value (NaN or Inf); the first at token 15, head 0" -- V --candidate "$T/lib/nan"
expect 1 "absent: lse, dq, dk, dv" -- V --candidate "$T/lib/no_lse_merge"

# JSON and heat map.
V --candidate "$T/lib/dropped_step" --json "$T/r.json" --heatmap "$T/h.svg" --quiet
[ $? = 1 ] || fail "--quiet run did not exit 1"
grep -q '"kind": "dropped_step"' "$T/r.json" || fail "JSON lacks the diagnosis kind"
grep -q '"passed": false' "$T/r.json" || fail "JSON lacks passed: false"
grep -q '<svg' "$T/h.svg" || fail "heat map is not an SVG"
grep -q 'query chunk 3 x KV chunk 1: 6' "$T/h.svg" || fail "heat map lacks the dropped pair"
# The outputs are written as a unit: --json a.json --heatmap /dev/full wrote a.json, then failed on
# the heat map (exit 2), so the failed run left a new a.json, or replaced an old one.
err=$(V --candidate "$T/lib/correct" --quiet --json "$T/a.json" --heatmap /dev/full 2>&1)
rc=$?
[ $rc = 2 ] && grep -q "/dev/full: write failed" <<<"$err" && [ ! -e "$T/a.json" ] ||
  fail "--json a.json --heatmap /dev/full: exit $rc (want 2), a.json $(ls "$T/a.json" 2>&1): $err"
echo old > "$T/a.json"
chmod 600 "$T/a.json"
err=$(V --candidate "$T/lib/dropped_step" --quiet --json "$T/a.json" --heatmap /dev/full 2>&1)
rc=$?
[ $rc = 2 ] && [ "$(cat "$T/a.json")" = old ] ||
  fail "--heatmap /dev/full replaced an existing --json (exit $rc): $err"
sh -c 'exit 0' & wait $!
dead=$!
echo partial > "$T/a.svg.tmp.$dead-s1"  # a killed run's staged file: removed
V --candidate "$T/lib/dropped_step" --quiet --json "$T/a.json" --heatmap "$T/a.svg"
[ $? = 1 ] && grep -q '"kind": "dropped_step"' "$T/a.json" && grep -q '<svg' "$T/a.svg" &&
  [ "$(stat -c %a "$T/a.json")" = 600 ] && [ -z "$(find "$T" -maxdepth 1 -name 'a.*.tmp.*')" ] ||
  fail "--json and --heatmap together: both written, a.json keeps its 0600, no temporaries left"
rm -f "$T/a.json" "$T/a.svg"

# loom attn's own outputs: every strategy and layout, global order.
for layout in contiguous zigzag stripe; do
  for sp in "ring 4" "ulysses 2" "hybrid 4 --ulysses 2" "allgather 4"; do
    set -- $sp
    strat=$1 P=$2
    shift 2
    out="$T/attn_${strat}_${layout}"
    "$LOOM" attn --input "$T/lib/input" --output "$out" --backward --strategy "$strat" \
      --ranks "$P" "$@" --layout "$layout" --iters 1 --warmup 0 --quiet >/dev/null ||
      { fail "loom attn $strat $layout"; continue; }
    expect 0 "verify    PASSED" -- "$LOOM" verify --input "$T/lib/input" --candidate "$out" \
      --convention "$layout" --ranks "$P"
  done
done
# Masks: packed documents and a sliding window.
"$LOOM" attn --input "$T/lib/input" --output "$T/attn_docs" --backward --ranks 3 --layout zigzag \
  --docs 40,56 --iters 1 --warmup 0 --quiet >/dev/null || fail "loom attn --docs"
expect 0 "verify    PASSED" -- "$LOOM" verify --input "$T/lib/input" --candidate "$T/attn_docs" \
  --docs 40,56 --convention zigzag --ranks 3
expect 1 "verify    FAILED" -- "$LOOM" verify --input "$T/lib/input" --candidate "$T/attn_docs" \
  --convention zigzag --ranks 3
mkdir -p "$T/in_cu" && cp "$T/lib/input/"*.npy "$T/in_cu/" && "$MK" --cu "$T/in_cu/cu_seqlens.npy" 40,56 ||
  fail "cu_seqlens"
expect 0 "verify    PASSED" -- "$LOOM" verify --input "$T/in_cu" --candidate "$T/attn_docs" \
  --convention zigzag --ranks 3
"$LOOM" attn --input "$T/lib/input" --output "$T/attn_win" --backward --ranks 4 --layout stripe \
  --window 17 --iters 1 --warmup 0 --quiet >/dev/null || fail "loom attn --window"
expect 0 "verify    PASSED" -- "$LOOM" verify --input "$T/lib/input" --candidate "$T/attn_win" \
  --window 17 --convention stripe --ranks 4
# bf16 storage: bf16 inputs, loom attn --dtype bf16, checked with bf16 tolerances (and failing
# the fp32 ones).
"$MK" --bf16 "$T/lib/input" "$T/in_bf16" || fail "bf16 inputs"
"$LOOM" attn --input "$T/in_bf16" --output "$T/attn_bf16" --backward --dtype bf16 --ranks 4 \
  --iters 1 --warmup 0 --quiet >/dev/null || fail "loom attn --dtype bf16"
expect 0 "verify    PASSED" -- "$LOOM" verify --input "$T/in_bf16" --candidate "$T/attn_bf16" \
  --dtype bf16 --convention zigzag --ranks 4
expect 1 "a bf16 implementation checked with fp32 tolerances; check it with --dtype bf16" -- "$LOOM" verify --input "$T/in_bf16" --candidate "$T/attn_bf16" \
  --convention zigzag --ranks 4
# Under 4 keys per query row (S = 2, causal) bf16 rounding of out moves dq and dk by more than the
# fixed 2u relative to their small norms (these inputs, loom attn on every path: dq 2.9-3.1 and dk
# 2.2-2.5 times 2u, reported FAILED with "no known defect"): each tensor is held to the problem's
# own bound, and a gross error still fails.
mkdir -p "$T/tiny32"
/usr/bin/python3 - "$T/tiny32" <<'PY' || fail "tiny inputs"
import numpy as np, sys
rng = np.random.default_rng(7)
for n, h in (("q", 2), ("k", 1), ("v", 1), ("dout", 2)):
    np.save(f"{sys.argv[1]}/{n}.npy", rng.standard_normal((2, h, 64)).astype(np.float32))
PY
"$MK" --bf16 "$T/tiny32" "$T/tiny" || fail "tiny bf16 inputs"
"$LOOM" attn --input "$T/tiny" --output "$T/attn_tiny" --backward --dtype bf16 --iters 1 \
  --warmup 0 --quiet >/dev/null || fail "loom attn --dtype bf16, S = 2"
expect 0 "held to this problem's own bound" -- "$LOOM" verify --input "$T/tiny" \
  --candidate "$T/attn_tiny" --dtype bf16 --json "$T/tiny.json"
grep -q '"bounds": "per-problem"' "$T/tiny.json" || fail "JSON lacks bounds: per-problem"
cp -r "$T/attn_tiny" "$T/attn_tiny_x3"
/usr/bin/python3 -c "import numpy as np, sys; f = sys.argv[1]; np.save(f, 3 * np.load(f))" \
  "$T/attn_tiny_x3/dq.npy" || fail "scaling dq"
expect 1 "dq   FAIL" -- "$LOOM" verify --input "$T/tiny" --candidate "$T/attn_tiny_x3" --dtype bf16
# Rows whose weight sits on one or two keys (loom/tolerance.h, the spread-weights condition): the
# fixed tolerances were claimed from 4 visible keys per row (bf16) or for any size (fp32), and
# loom's own correct outputs FAILED ("dq FAIL ... no known defect explains the dq error"): bf16
# S = 4, H = 4 over 2, D = 8 at scale 1.41; fp32 S = 2, D = 8 at scale 2, both full. They are held
# to their own bounds, saying why, and a gross error still fails.
for c in "bf16 4 4 2 1.41421 2" "fp32 2 1 1 2 1"; do
  set -- $c
  mkdir -p "$T/few_$1_32"
  /usr/bin/python3 - "$T/few_$1_32" "$2" "$3" "$4" "$6" <<'PY' || fail "few-keys inputs"
import numpy as np, sys
d, s, h, hkv, seed = sys.argv[1], *map(int, sys.argv[2:])
rng = np.random.default_rng(seed)
for n, heads in (("q", h), ("k", hkv), ("v", hkv), ("dout", h)):
    np.save(f"{d}/{n}.npy", rng.standard_normal((s, heads, 8)).astype(np.float32))
PY
  in="$T/few_$1_32"
  if [ "$1" = bf16 ]; then
    in="$T/few_$1_bf16"
    "$MK" --bf16 "$T/few_$1_32" "$in" || fail "few-keys bf16 inputs"
  fi
  "$LOOM" attn --input "$in" --output "$T/few_$1_out" --backward --dtype "$1" --no-causal \
    --scale "$5" --iters 1 --warmup 0 --quiet >/dev/null || fail "loom attn $1, few keys"
  expect 0 "effective keys per query row .*held to this problem's own bound" -- "$LOOM" verify \
    --input "$in" --candidate "$T/few_$1_out" --dtype "$1" --no-causal --scale "$5"
  cp -r "$T/few_$1_out" "$T/few_$1_x3"
  /usr/bin/python3 -c "import numpy as np, sys; f = sys.argv[1]; np.save(f, 3 * np.load(f))" \
    "$T/few_$1_x3/dq.npy" || fail "scaling dq"
  expect 1 "dq   FAIL" -- "$LOOM" verify --input "$in" --candidate "$T/few_$1_x3" --dtype "$1" \
    --no-causal --scale "$5"
done
# fp32 past the scores' regime (|scale| max||q|| max||k|| > 128): the fixed 1e-5 failed a correct
# result (--scale 10, S = 256, D = 64: dq 1.4e-5, as PyTorch's fp32 attention); each tensor is held
# to the problem's bound for any implementation, and an error of 5 % in dq still fails.
mkdir -p "$T/big32"
/usr/bin/python3 - "$T/big32" <<'PY' || fail "large-score inputs"
import numpy as np, sys
rng = np.random.default_rng(11)
for n, h in (("q", 2), ("k", 2), ("v", 2), ("dout", 2)):
    np.save(f"{sys.argv[1]}/{n}.npy", rng.standard_normal((256, h, 64)).astype(np.float32))
PY
"$LOOM" attn --input "$T/big32" --output "$T/attn_big" --backward --scale 10 --iters 1 \
  --warmup 0 --quiet >/dev/null || fail "loom attn --scale 10"
expect 0 "scores up to .* held to this problem's own bound" -- "$LOOM" verify --input "$T/big32" \
  --candidate "$T/attn_big" --scale 10
cp -r "$T/attn_big" "$T/attn_big_dq"
/usr/bin/python3 -c "import numpy as np, sys; f = sys.argv[1]; np.save(f, 1.05 * np.load(f))" \
  "$T/attn_big_dq/dq.npy" || fail "scaling dq"
expect 1 "dq   FAIL" -- "$LOOM" verify --input "$T/big32" --candidate "$T/attn_big_dq" --scale 10
# At scale 1000 dq's bound passes zeros: refused as unverifiable (exit 2), not passed.
expect 2 "dq cannot be verified: this problem's fp32 error bound for it is" -- "$LOOM" verify \
  --input "$T/big32" --candidate "$T/attn_big" --scale 1000
# At scale 1e8 each row's weight sits on one key: out is that key's value, bitwise, and is passed
# as exact although its bound passes zeros (it was "out cannot be verified", as `loom attn
# --check` passes it); one value changed makes it unverifiable again, not passed.
"$LOOM" attn --input "$T/big32" --output "$T/attn_onehot" --scale 1e8 --iters 1 --warmup 0 \
  --quiet >/dev/null || fail "loom attn --scale 1e8"
rm -f "$T/attn_onehot/lse.npy"
expect 0 "out  pass  rel 0  max abs 0  tol not computable  (the exact values)" -- "$LOOM" verify \
  --input "$T/big32" --candidate "$T/attn_onehot" --scale 1e8
/usr/bin/python3 -c "import numpy as np, sys; f = sys.argv[1]; a = np.load(f); a[3, 1, 5] += 1e-3
np.save(f, a)" "$T/attn_onehot/out.npy" || fail "changing out"
expect 2 "out cannot be verified: this problem's fp32 error bound for it is" -- "$LOOM" verify \
  --input "$T/big32" --candidate "$T/attn_onehot" --scale 1e8
# Values all equal make the exact dq and dk zeros: held to their bounds as absolute ones (8.28 and
# 12 here, which pass zeros), and passed, where they were "cannot be verified".
mkdir -p "$T/equal_v"
cp "$T/big32/q.npy" "$T/big32/k.npy" "$T/big32/dout.npy" "$T/equal_v/"
/usr/bin/python3 -c "import numpy as np, sys; np.save(sys.argv[1], np.full((256, 2, 64), 0.5,
np.float32))" "$T/equal_v/v.npy" || fail "writing equal v"
"$LOOM" attn --input "$T/equal_v" --output "$T/attn_equal_v" --backward --scale 1000 --iters 1 \
  --warmup 0 --quiet >/dev/null || fail "loom attn, equal v"
expect 0 "dk   pass  rel 0  max abs 0  tol " -- "$LOOM" verify --input "$T/equal_v" \
  --candidate "$T/attn_equal_v" --scale 1000
# At scale 3e38 the bound's own arithmetic overflows: said so (it printed "-nan").
expect 2 "error bound for it is not computable (the inputs' magnitude overflows it)" -- \
  "$LOOM" verify --input "$T/big32" --candidate "$T/attn_big" --scale 3e38
# Its article: "(a out of zeros would pass; ...".
expect 2 "overflows it) (an out of zeros would pass; scores up to" -- \
  "$LOOM" verify --input "$T/big32" --candidate "$T/attn_big" --scale 3e38
# The same outputs handed over per rank in every convention.
for conv in contiguous zigzag stripe rfa-zigzag te-thd torch-headtail megatron; do
  "$MK" --shard "$T/attn_ring_zigzag" "$T/shard_$conv" "$conv" 4 || fail "shard $conv"
  expect 0 "verify    PASSED" -- "$LOOM" verify --input "$T/lib/input" \
    --candidate "$T/shard_$conv" --convention "$conv" --ranks 4
done
# A wrong convention is caught: zigzag files read as contiguous. It is the one diagnosis (it was
# followed by "or no known defect explains the out error", fitted to rows in the wrong order).
expect 1 "the per-rank files are in zigzag order, not contiguous" -- "$LOOM" verify --input "$T/lib/input" \
  --candidate "$T/shard_zigzag" --convention contiguous --ranks 4
out=$("$LOOM" verify --input "$T/lib/input" --candidate "$T/shard_zigzag" --convention contiguous \
  --ranks 4 --json "$T/wc.json" 2>&1)
grep -q "the errors above and the heat map read them in contiguous order" <<<"$out" &&
  ! grep -q "^  or " <<<"$out" && [ "$(grep -c '"kind"' "$T/wc.json")" = 1 ] ||
  fail "wrong convention: not the only diagnosis: $out"
# Layouts on disk.
for dims in BSHD HSD; do
  "$MK" --relayout "$T/lib/input" "$T/in_$dims" "$dims" && "$MK" --relayout "$T/attn_ring_zigzag" "$T/c_$dims" "$dims" ||
    fail "relayout $dims"
  expect 0 "verify    PASSED" -- "$LOOM" verify --input "$T/in_$dims" --candidate "$T/c_$dims" \
    --layout-dims "$dims"
done

# Unusable input: exit status 2 with one line.
expect 2 "--input $T/nope: No such file or directory" -- "$LOOM" verify --input "$T/nope" \
  --candidate "$T/lib/correct"
ln -s cloop "$T/cloop"  # std::filesystem's own text, naming no option, before
expect 2 "--candidate $T/cloop: Too many levels of symbolic links" -- "$LOOM" verify \
  --input "$T/lib/input" --candidate "$T/cloop"
# contiguous with documents is per document (rank r holds piece r of each), and the error says so.
expect 2 "gives rank 0 25 rows of \[2, 16\] (with 2 documents, contiguous cuts each document into 4 pieces" -- "$LOOM" verify --input "$T/lib/input" --candidate "$T/lib/correct" --convention contiguous --ranks 4 --docs 90,6
expect 2 "but --ranks is 3" -- "$LOOM" verify --input "$T/lib/input" --candidate "$T/lib/correct" --convention zigzag --ranks 3
expect 2 "unknown convention" -- "$LOOM" verify --input "$T/lib/input" --candidate "$T/lib/correct" --convention nonsense
expect 2 "te-thd needs every" -- "$LOOM" verify --input "$T/lib/input" --candidate "$T/lib/correct" --convention te-thd --ranks 4 --docs 90,6
expect 2 "unknown --layout-dims" -- V --candidate "$T/lib/correct" --layout-dims XYZ
mkdir -p "$T/empty"
expect 2 "holds none of out" -- V --candidate "$T/empty"
printf 'not a npy' >"$T/empty/out.npy"
expect 2 "out.npy" -- V --candidate "$T/empty"

# BSHD: every tensor must hold q's batch elements. A candidate with fewer was read past its end
# (garbage or a crash), one with more passed with its extra elements never checked, and an
# input with none passed silently (a crash with --heatmap).
/usr/bin/python3 - "$T/in_BSHD" "$T/c_BSHD" "$T/bshd" <<'PY' || fail "BSHD batch files"
import os, sys
import numpy as np
src_in, src_c, dst = sys.argv[1:4]
def save(d, name, x):
    os.makedirs(d, exist_ok=True)
    np.save(os.path.join(d, name + ".npy"), x)
ld = lambda d, n: np.load(os.path.join(d, n + ".npy"))
for n in ("q", "k", "v"):
    save(dst + "/in2", n, np.concatenate([ld(src_in, n)] * 2))
    save(dst + "/in0", n, ld(src_in, n)[:0])
out = ld(src_c, "out")
save(dst + "/c1", "out", out)
save(dst + "/c2", "out", np.concatenate([out, np.full_like(out, 7.0)]))
PY
expect 2 "out.npy has shape \[1, 96, 2, 16\]: 1 batch elements, but q.npy has 2" -- \
  "$LOOM" verify --input "$T/bshd/in2" --candidate "$T/bshd/c1" --layout-dims BSHD
expect 2 "out.npy has shape \[2, 96, 2, 16\]: 2 batch elements, but q.npy has 1" -- \
  "$LOOM" verify --input "$T/in_BSHD" --candidate "$T/bshd/c2" --layout-dims BSHD
expect 2 "no batch elements to check" -- \
  "$LOOM" verify --input "$T/bshd/in0" --candidate "$T/bshd/c1" --layout-dims BSHD \
  --heatmap "$T/bshd/h.svg"
expect 0 "verify    PASSED" -- "$LOOM" verify --input "$T/in_BSHD" --candidate "$T/bshd/c1" \
  --layout-dims BSHD
# Finite inputs whose scores overflow float64: the reference was NaN and a correct out (v = 1, so
# out = 1 whatever the weights) "failed" with rel inf and a dropped-step diagnosis.
/usr/bin/python3 - "$T/big" <<'PY' || fail "overflowing inputs"
import os, sys
import numpy as np
d = sys.argv[1]
os.makedirs(d + "/in", exist_ok=True)
os.makedirs(d + "/c", exist_ok=True)
q = np.full((8, 2, 4), 1e200)
np.save(d + "/in/q.npy", q)
np.save(d + "/in/k.npy", q)
np.save(d + "/in/v.npy", np.ones((8, 2, 4)))
np.save(d + "/c/out.npy", np.ones((8, 2, 4)))
PY
expect 2 "the fp64 reference out is not finite" -- "$LOOM" verify --input "$T/big/in" \
  --candidate "$T/big/c"
# cu_seqlens.npy is read like every other input: a FIFO refused at once, a malformed header named.
mkdir -p "$T/cu_fifo" && cp "$T/lib/input/"*.npy "$T/cu_fifo/" && mkfifo "$T/cu_fifo/cu_seqlens.npy"
expect 2 "cu_seqlens.npy: is not a regular file" -- timeout 20 "$LOOM" verify \
  --input "$T/cu_fifo" --candidate "$T/attn_docs" --convention zigzag --ranks 3
mkdir -p "$T/cu_bad" && cp "$T/lib/input/"*.npy "$T/cu_bad/"
"$MK" --cu "$T/cu_bad/cu_seqlens.npy" 40,56 && sed -i 's/(3,)/(,) /' "$T/cu_bad/cu_seqlens.npy" ||
  fail "malformed cu_seqlens"
# "(,)" is no Python tuple (numpy refuses it): named as a malformed shape, not read as [].
expect 2 "cu_seqlens.npy: malformed shape (,) in npy header" -- "$LOOM" verify --input "$T/cu_bad" \
  --candidate "$T/attn_docs" --convention zigzag --ranks 3
# An unwritable output is refused before the inputs are read (it failed after the check).
expect 2 "--json $T/nodir/r.json: cannot write into" -- V --candidate "$T/lib/correct" \
  --json "$T/nodir/r.json" --quiet
# Two outputs on one path: refused before anything is written.
expect 2 "name the same file" -- V --candidate "$T/lib/correct" --json "$T/same" --heatmap "$T/same"
cp -r "$T/lib/input" "$T/in_copy"
expect 2 "and --input's q.npy name the same file" -- "$LOOM" verify --input "$T/in_copy" \
  --candidate "$T/lib/correct" --convention zigzag --ranks 4 --json "$T/in_copy/q.npy"
cmp -s "$T/lib/input/q.npy" "$T/in_copy/q.npy" || fail "--json replaced q.npy"

# Audit (CLI defects). Each of these failed on the code before it.
# Outputs into the candidate directory: --json CAND/out.rank0.npy replaced the candidate's out
# with the report and exited 0; --json CAND/dq.rank9.npy planted a file. Refused, nothing written.
cp -r "$T/lib/correct" "$T/cand"
sum_before=$(cd "$T/cand" && md5sum ./* | md5sum)
expect 2 "is inside --candidate $T/cand" -- V --candidate "$T/cand" --quiet \
  --json "$T/cand/out.rank0.npy"
expect 2 "is inside --candidate" -- V --candidate "$T/cand/" --quiet --json "$T/cand/dq.rank9.npy"
expect 2 "is inside --candidate" -- V --candidate "$T/cand" --quiet --heatmap "$T/cand/h.svg"
ln -s "$T/cand/out.rank0.npy" "$T/alias.npy"
expect 2 "is inside --candidate" -- V --candidate "$T/cand" --quiet --json "$T/alias.npy"
# A hard link to a candidate file was accepted (and replaced by the report) where one to an input
# was refused.
ln "$T/cand/out.rank0.npy" "$T/hard_alias.npy"
expect 2 "the candidate's out.rank0.npy name the same file (hard links to one file)" -- \
  V --candidate "$T/cand" --quiet --json "$T/hard_alias.npy"
cmp -s "$T/cand/out.rank0.npy" "$T/hard_alias.npy" || fail "--json replaced a hard link's file"
[ "$(cd "$T/cand" && md5sum ./* | md5sum)" = "$sum_before" ] ||
  fail "an output was written into the candidate directory"
# Per-rank files that are not a whole set: out.rank1.npy without out.rank0.npy was "PASSED ...
# absent: out" (never read); a rank past --ranks or a non-decimal rank was ignored.
mkdir -p "$T/partial" && cp "$T/lib/correct/out.rank1.npy" "$T/partial/"
expect 2 "has out.rank1.npy but not out.rank0.npy" -- "$LOOM" verify --input "$T/lib/input" \
  --candidate "$T/partial" --convention zigzag --ranks 2
cp -r "$T/lib/correct" "$T/stray" && cp "$T/lib/correct/dq.rank0.npy" "$T/stray/dq.rank7.npy"
expect 2 "dq.rank7.npy but --ranks is 4" -- V --candidate "$T/stray"
rm "$T/stray/dq.rank7.npy" && mv "$T/stray/lse.rank2.npy" "$T/stray/lse.rank02.npy"
expect 2 "lse.rank02.npy, which is not a per-rank name" -- V --candidate "$T/stray"
# --scale 0 meant "the default" (and passed); every given scale must be positive and finite.
for s in 0 -0 -1 nan inf; do
  expect 2 "--scale must be a positive finite number" -- V --candidate "$T/lib/correct" --scale $s
done
# Taken in float32: a scale past its range is refused as such (1e39 was "out cannot be verified:
# ... bound ... not computable"); float32's largest, as printed, is taken (and then held to the
# problem's bound, which overflows at that scale, as at 3e38 above).
expect 2 "--scale 1e+39 overflows float32 (at most 3.4028235e+38)" -- V --candidate "$T/lib/correct" \
  --scale 1e39
expect 2 "--scale 3.5e+38 overflows float32" -- V --candidate "$T/lib/correct" --scale 3.5e38
expect 2 "out cannot be verified: this problem's fp32 error bound for it is not computable" -- \
  V --candidate "$T/lib/correct" --scale 3.4028235e38
# A failed write of the text report is exit 2 like every error but a failed tensor (it was 1, "a
# tensor failed"), whether the tensors passed or failed, to a full or a closed standard output.
for c in correct dropped_step; do
  err=$(V --candidate "$T/lib/$c" 2>&1 >/dev/full)
  rc=$?
  [ $rc = 2 ] && grep -q "standard output: write failed (No space left on device)" <<<"$err" ||
    fail "verify $c > /dev/full: exit $rc (want 2): $err"
  err=$(V --candidate "$T/lib/$c" 2>&1 >&-)
  rc=$?
  [ $rc = 2 ] && grep -q "standard output: write failed" <<<"$err" ||
    fail "verify $c with standard output closed: exit $rc (want 2): $err"
  # A failed run leaves its files as they were (--json was written before standard output's
  # failure was found), with one error line.
  echo old > "$T/a.json"
  err=$(V --candidate "$T/lib/$c" --json "$T/a.json" --heatmap "$T/a.svg" 2>&1 >/dev/full)
  rc=$?
  [ $rc = 2 ] && [ "$(cat "$T/a.json")" = old ] && [ ! -e "$T/a.svg" ] &&
    [ "$(grep -c . <<<"$err")" = 1 ] ||
    fail "verify $c --json a.json > /dev/full: exit $rc, a.json $(head -c 20 "$T/a.json"): $err"
  rm -f "$T/a.json" "$T/a.svg"
done
expect 0 "verify    PASSED" -- V --candidate "$T/lib/correct" --scale 0.25
expect 1 "wrong softmax scale" -- V --candidate "$T/lib/correct" --scale 0.5
# --ranks past the sequence length: exit 1 "out of memory (an allocation outside loom's tensors
# failed)".
expect 2 "--ranks must be in \[1, 96\]" -- "$LOOM" verify --input "$T/lib/input" \
  --candidate "$T/lib/correct" --ranks 2147483647
expect 2 "--ranks must be in \[1, 96\]" -- "$LOOM" verify --input "$T/lib/input" \
  --candidate "$T/lib/correct" --ranks 97
# Malformed command lines: exit 2, one line (docs/verify.md said 105-114).
# Each names its own mistake: `--bogus` said "--input is required" (CLI11 checked the required
# options first).
for case in "--bogus|not expected: --bogus" "--input $T/lib/input|--candidate is required" \
  "--input $T/lib/input --candidate $T/cand --ranks abc|--ranks"; do
  args=${case%%|*} needle=${case#*|}
  out=$("$LOOM" verify $args 2>&1 >/dev/null)
  rc=$?
  [ $rc = 2 ] && [ "$(printf '%s\n' "$out" | wc -l)" = 1 ] && grep -q "^loom: error: " <<<"$out" &&
    grep -qF -- "$needle" <<<"$out" || fail "usage error '$args': exit $rc, '$out' (want '$needle')"
done
# An output on a pseudo file system is refused before the run (root passed access()).
expect 2 "--json /proc/version: cannot write into /proc" -- V --candidate "$T/lib/correct" \
  --json /proc/version
# One line on stderr, exit status 2, matching PATTERN: expect2 PATTERN -- command...
expect2() {
  local pat=$1
  shift 2
  local err rc
  err=$("$@" 2>&1 >/dev/null)
  rc=$?
  [ $rc = 2 ] && [ "$(printf '%s\n' "$err" | wc -l)" = 1 ] && grep -q -- "$pat" <<<"$err" ||
    fail "exit $rc, '$err' (want 2, one line with '$pat'): $*"
}
# A 0-d or 1-d q.npy was indexed as [S, H, D]: a raw "vector::_M_range_check" and exit status 1
# ("a tensor failed").
for shape in "()" "(8,)"; do
  mkdir -p "$T/qdim"
  /usr/bin/python3 -c "import numpy as np, sys; [np.save(f'$T/qdim/{n}.npy', np.ones($shape, np.float32)) for n in 'qkv']" ||
    fail "q of shape $shape"
  want=$([ "$shape" = "()" ] && echo "\[\]" || echo "\[8\]")
  expect2 "q.npy has shape $want but --layout-dims SHD needs \[S, H, D\]" -- "$LOOM" verify \
    --input "$T/qdim" --candidate "$T/attn_ring_zigzag"
  expect2 "q.npy has shape $want but --layout-dims BSHD needs \[B, S, H, D\]" -- "$LOOM" verify \
    --input "$T/qdim" --candidate "$T/attn_ring_zigzag" --layout-dims BSHD
done
# A per-rank shape error named the right rank and the shape q gives: rank 0's sizes were the
# expected ones, so a wrong dq.rank0 was blamed on rank 1 ("dq.rank1 has shape [24, 2, 16] but
# ... gives rank 1 24 rows of [1, 16]"), and lse [n, H] on every rank asked for [24, 24].
cp -r "$T/lib/correct" "$T/shape0" && cp -r "$T/lib/correct" "$T/lseT" &&
  /usr/bin/python3 - "$T/shape0" "$T/lseT" <<'PY' || fail "bad per-rank shapes"
import numpy as np, sys
f = sys.argv[1] + "/dq.rank0.npy"
np.save(f, np.load(f)[:, :1].copy())
for r in range(4):
    f = f"{sys.argv[2]}/lse.rank{r}.npy"
    np.save(f, np.load(f).T.copy())
PY
expect2 "dq.rank0 has shape \[24, 1, 16\] but zigzag with 4 ranks gives rank 0 24 rows of \[2, 16\]" -- \
  V --candidate "$T/shape0"
expect2 "lse.rank0 has shape \[24, 2\] but zigzag with 4 ranks gives rank 0 \[2, 24\]" -- \
  V --candidate "$T/lseT"
# A q of no tokens was "--ranks must be in [1, 0] ..., got 1".
mkdir -p "$T/q0" && /usr/bin/python3 -c "import numpy as np; [np.save(f'$T/q0/{n}.npy', np.ones((0, 2, 16), np.float32)) for n in 'qkv']" ||
  fail "q of no tokens"
expect2 "q.npy has shape \[0, 2, 16\]: no tokens (S = 0), nothing to verify" -- "$LOOM" verify \
  --input "$T/q0" --candidate "$T/attn_ring_zigzag"
cp -r "$T/lib/input" "$T/kdim" && /usr/bin/python3 -c "import numpy as np; np.save('$T/kdim/k.npy', np.ones(8, np.float32))"
expect2 "k.npy has shape \[8\] but --layout-dims SHD needs" -- "$LOOM" verify --input "$T/kdim" \
  --candidate "$T/attn_ring_zigzag"
# --json - and --heatmap -: the text report was mixed into standard output with the JSON (or SVG).
if "$LOOM" verify --input "$T/lib/input" --candidate "$T/attn_ring_zigzag" --json - 2>/dev/null |
  /usr/bin/python3 -c "import json, sys; assert json.load(sys.stdin)['passed'] is True" 2>/dev/null; then :; else
  fail "--json - is not JSON alone on standard output"
fi
out=$("$LOOM" verify --input "$T/lib/input" --candidate "$T/lib/dropped_step" --convention zigzag \
  --ranks 4 --heatmap - 2>/dev/null)
rc=$?
[ $rc = 1 ] && [ "${out:0:1}" = "<" ] && ! grep -q "verify    FAILED" <<<"$out" ||
  fail "--heatmap -: exit $rc, standard output starts '${out:0:40}'"
# A dangling symlink among the inputs or the candidate's files was silently ignored
# (fs::exists follows links): cu_seqlens.npy -> nowhere passed without the document mask, a
# dangling out.npy was "absent: out". Now it is an input that cannot be opened.
cp -r "$T/lib/input" "$T/dang_in" && ln -s nowhere.npy "$T/dang_in/cu_seqlens.npy"
expect2 "cu_seqlens.npy: cannot open" -- "$LOOM" verify --input "$T/dang_in" \
  --candidate "$T/attn_ring_zigzag"
rm "$T/dang_in/cu_seqlens.npy" "$T/dang_in/dout.npy" && ln -s nowhere.npy "$T/dang_in/dout.npy"
expect2 "dout.npy: cannot open" -- "$LOOM" verify --input "$T/dang_in" \
  --candidate "$T/attn_ring_zigzag"
cp -r "$T/attn_ring_zigzag" "$T/dang_c" && rm "$T/dang_c/out.npy" &&
  ln -s nowhere.npy "$T/dang_c/out.npy"
expect2 "out.npy: cannot open" -- "$LOOM" verify --input "$T/lib/input" --candidate "$T/dang_c"
# q of 1e-42 makes the exact dk subnormal in float32 (rounding it alone errs 1e-3): loom's correct
# dk "FAILED" at 0.006 (exit 1); such a tensor cannot be verified (exit 2).
/usr/bin/python3 - "$T/sub42" <<'PY'
import numpy as np, os, sys
d = sys.argv[1]
os.makedirs(d)
r = np.random.default_rng(0)
np.save(f"{d}/q.npy", (r.standard_normal((32, 2, 8)) * 1e-42).astype(np.float32))
for n, h in (("k", 1), ("v", 1), ("dout", 2)):
    np.save(f"{d}/{n}.npy", r.standard_normal((32, h, 8)).astype(np.float32))
PY
"$LOOM" attn --input "$T/sub42" --backward --iters 1 --warmup 0 --quiet --output "$T/sub42_c" >/dev/null ||
  fail "loom attn on the inputs of 1e-42"
expect2 "dk cannot be verified: its exact values or the terms that sum to them lie below float32's normal range" -- \
  "$LOOM" verify --input "$T/sub42" --candidate "$T/sub42_c"
# v of 1e-39: the terms of dq (dp = dout . v, ds) are subnormal, dq is not as far down, and loom's
# correct dq "FAILED" at 2.1e-5 (exit 1): rounding the exact dq alone errs only 2e-6, the terms'
# roundings (subnormal_reference) 1.6e-5.
/usr/bin/python3 - "$T/subv" <<'PY'
import numpy as np, os, sys
d = sys.argv[1]
os.makedirs(d)
r = np.random.default_rng(0)
for n, f in (("q", 1), ("k", 1), ("v", 1e-39), ("dout", 1)):
    np.save(f"{d}/{n}.npy", (r.standard_normal((128, 2, 16)) * f).astype(np.float32))
PY
"$LOOM" attn --input "$T/subv" --backward --iters 1 --warmup 0 --quiet --output "$T/subv_c" >/dev/null ||
  fail "loom attn on values of 1e-39"
expect2 "dq cannot be verified: its exact values or the terms that sum to them lie below float32's normal range" -- \
  "$LOOM" verify --input "$T/subv" --candidate "$T/subv_c"
# A bf16 candidate's out of v = 3e-39 is bf16 values, whose subnormals end at 2^-133: loom's own
# correct bf16 out "FAILED" at 0.025 (exit 1), where rounding the exact out to bf16 alone errs
# 0.024.
/usr/bin/python3 - "$T/bf16v" <<'PY'
import numpy as np, os, sys
d = sys.argv[1]
os.makedirs(d)
r = np.random.default_rng(7)
def bf16(a):
    return (a.astype(np.float32).view(np.uint32) & np.uint32(0xffff0000)).view(np.float32)
for n, f, h in (("q", 1, 2), ("k", 1, 1), ("v", 3e-39, 1)):
    np.save(f"{d}/{n}.npy", bf16(r.standard_normal((64, h, 16)) * f))
PY
"$LOOM" attn --input "$T/bf16v" --dtype bf16 --iters 1 --warmup 0 --quiet --output "$T/bf16v_c" \
  >/dev/null || fail "loom attn --dtype bf16 on values of 3e-39"
expect2 "out cannot be verified: .*(bf16 alone errs" -- \
  "$LOOM" verify --input "$T/bf16v" --candidate "$T/bf16v_c" --dtype bf16

# Above --full-check-max only sampled rows are compared, and dk, dv not at all: a NaN in an
# unsampled row of out, and a dk and dv of NaN, PASSED (exit 0), as did dk and dv alone (nothing
# compared). Every element is now scanned for NaN and Inf, and nothing compared is exit 2.
/usr/bin/python3 - "$T/samp" <<'PY'
import numpy as np, os, sys
d = sys.argv[1]
os.makedirs(d)
r = np.random.default_rng(3)
for n in ("q", "k", "v", "dout"):
    np.save(f"{d}/{n}.npy", r.standard_normal((300, 1, 8)).astype(np.float32))
PY
"$LOOM" attn --input "$T/samp" --backward --iters 1 --warmup 0 --quiet --output "$T/samp_ref" >/dev/null ||
  fail "loom attn on the sampled problem"
SV() { "$LOOM" verify --input "$T/samp" --full-check-max 64 "$@"; }
expect 0 "out  pass .*(sampled rows)" -- SV --candidate "$T/samp_ref"
expect 0 "dk   not compared (dk and dv need every query row.*no NaN or Inf in it" -- SV --candidate "$T/samp_ref"
# ... and the first line says so: "PASSED" alone read as every tensor checked.
expect 0 "verify    PASSED  (.*), dk and dv not compared (--full-check-max)" -- SV --candidate "$T/samp_ref"
mkdir -p "$T/samp_nan_out" "$T/samp_nan_dk" "$T/samp_dkdv"
cp "$T/samp_ref/dk.npy" "$T/samp_ref/dv.npy" "$T/samp_dkdv/"
/usr/bin/python3 - "$T" <<'PY'
import numpy as np, sys
t = sys.argv[1]
o = np.load(f"{t}/samp_ref/out.npy"); o[1, 0, 3] = np.nan  # row 1 is not among the sampled rows
np.save(f"{t}/samp_nan_out/out.npy", o)
k = np.load(f"{t}/samp_ref/dk.npy"); k[:] = np.nan
np.save(f"{t}/samp_nan_dk/dk.npy", k); np.save(f"{t}/samp_nan_dk/dv.npy", k)
np.save(f"{t}/samp_nan_dk/out.npy", np.load(f"{t}/samp_ref/out.npy"))
PY
expect 1 "out  FAIL .*1 non-finite" -- SV --candidate "$T/samp_nan_out"
expect 1 "dk   FAIL  2400 non-finite (its values are not compared: dk and dv need every query row" -- SV --candidate "$T/samp_nan_dk"
expect2 "nothing could be compared: dk and dv need every query row, and S = 300 is above the full-check limit of 64" \
  -- SV --candidate "$T/samp_dkdv"
expect 0 "dk   pass" -- "$LOOM" verify --input "$T/samp" --candidate "$T/samp_dkdv" --full-check-max 300
# A "sample" of 256 rows of a sequence of at most 256 tokens is every row: dk and dv are compared
# there whatever --full-check-max says (a dk of zeros at S = 200, --full-check-max 16, PASSED).
/usr/bin/python3 - "$T" <<'PY'
import numpy as np, os, sys
t = sys.argv[1]
os.makedirs(f"{t}/s200")
r = np.random.default_rng(4)
for n in ("q", "k", "v", "dout"):
    np.save(f"{t}/s200/{n}.npy", r.standard_normal((200, 1, 8)).astype(np.float32))
PY
"$LOOM" attn --input "$T/s200" --backward --iters 1 --warmup 0 --quiet --output "$T/s200_ref" >/dev/null ||
  fail "loom attn on the 200-token problem"
mkdir -p "$T/s200_zdk"
cp "$T/s200_ref/out.npy" "$T/s200_ref/dv.npy" "$T/s200_zdk/"
/usr/bin/python3 -c "import numpy as np, sys; np.save(sys.argv[1], np.zeros((200, 1, 8), np.float32))" \
  "$T/s200_zdk/dk.npy"
expect 1 "dk   FAIL  rel 1" -- "$LOOM" verify --input "$T/s200" --candidate "$T/s200_zdk" --full-check-max 16
expect 0 "dv   pass  rel .*e-0[6-9]  max abs" -- "$LOOM" verify --input "$T/s200" --candidate "$T/s200_ref" --full-check-max 16
# Localisation's work grows as ranks^2 x chunks: 128 ranks took 94 s, 2048 ran for minutes. Past
# its budget it is skipped, and said so; the verdict stands.
/usr/bin/python3 - "$T/wide" <<'PY'
import numpy as np, os, sys
d = sys.argv[1]
os.makedirs(d)
r = np.random.default_rng(4)
for n in ("q", "k", "v"):
    np.save(f"{d}/{n}.npy", r.standard_normal((512, 2, 64)).astype(np.float32))
PY
"$LOOM" attn --input "$T/wide" --iters 1 --warmup 0 --quiet --output "$T/wide_ref" >/dev/null ||
  fail "loom attn on the wide problem"
mkdir -p "$T/wide_off"
/usr/bin/python3 -c "import numpy as np; o = np.load('$T/wide_ref/out.npy'); o *= 1.01; np.save('$T/wide_off/out.npy', o)"
start=$(date +%s)
expect 1 "diagnosis not localised: 512 ranks and 512 chunks are past the localisation's budget" -- \
  "$LOOM" verify --input "$T/wide" --candidate "$T/wide_off" --ranks 512
expect 1 "diagnosis no known defect explains the out error" -- \
  "$LOOM" verify --input "$T/wide" --candidate "$T/wide_off" --ranks 128
[ $(( $(date +%s) - start )) -le 30 ] || fail "verify --ranks 512 and 128 took over 30 s"
# A scale below float32's normal range was refused as "got 0" (5e-324) or accepted (1e-44).
expect2 "--scale 1e-44 is subnormal in float32" -- SV --candidate "$T/samp_ref" --scale 1e-44
expect2 "--scale 5e-324 rounds to 0 in float32" -- SV --candidate "$T/samp_ref" --scale 5e-324

# Memory is estimated from the .npy headers and refused before any body is read, in one line
# naming the estimate and the limit (docs/verify.md, "Memory"): a long-context candidate (40 GiB
# in double) was read piece by piece until the process was killed or ran out of memory.
expect2 "^loom: error: loom verify needs about [0-9.]* MiB (estimate) but the memory limit is 1.0 MiB (--memory-limit); make the problem smaller or raise --memory-limit$" \
  -- V --candidate "$T/lib/correct" --memory-limit 1M
expect 0 "verify    PASSED" -- V --candidate "$T/lib/correct" --memory-limit 64G
# --memory-limit is read as loom attn reads it.
expect2 "^loom: error: --memory-limit must be a positive size below 8 EiB, got '0'$" -- \
  V --candidate "$T/lib/correct" --memory-limit 0
expect2 "^loom: error: --memory-limit '-1' is not a size (expected bytes" -- \
  V --candidate "$T/lib/correct" --memory-limit -1
expect2 "^loom: error: --memory-limit 'abc' is not a size (expected bytes" -- \
  V --candidate "$T/lib/correct" --memory-limit abc
# An address-space limit that loom starts under but the inputs cannot fit: refused from the
# headers (sparse files of 128 MiB, 1 GiB in double), not "out of memory" half way through them.
/usr/bin/python3 - "$T/sparse" <<'PY'
import os, struct, sys
d = sys.argv[1]
for sub, names in (("in", ("q", "k", "v", "dout")), ("cand", ("out",))):
    os.makedirs(f"{d}/{sub}")
    shape = (65536, 8, 64)
    h = ("{'descr': '<f4', 'fortran_order': False, 'shape': %s, }" % (shape,)).encode()
    h += b" " * ((64 - (11 + len(h)) % 64) % 64) + b"\n"
    head = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h
    for n in names:
        with open(f"{d}/{sub}/{n}.npy", "wb") as f:
            f.write(head)
            f.truncate(len(head) + 4 * shape[0] * shape[1] * shape[2])
PY
expect2 "^loom: error: loom verify needs about [0-9.]* GiB of address space (estimate) but the address-space limit (ulimit -v) of 390.6 MiB, of which [0-9.]* MiB is mapped already, leaves" \
  -- env OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 bash -c \
  'ulimit -v 400000; exec "$0" verify --input "$1/in" --candidate "$1/cand"' "$LOOM" "$T/sparse"
rm -rf "$T/sparse"
# The estimate bounds the peak resident set, and is not far above it: a pass (global and per-rank
# files), a failure whose localisation models GQA (1 < Hkv < H), on 256 sampled rows with
# gradients, and both with every row checked; and a pass outside the fixed tolerances' regime (q
# of 40 N(0, 1): scores past 128), on sampled rows, held to the problem's own bounds. The peak is
# what /usr/bin/time reports: a child of Python counts Python's own resident set from before its
# exec.
# Nor does a run hold copies of what it read (docs/verify.md, "Memory"): beyond a tiny run's peak
# (the process itself), a pass holds the files' data in float64, the per-rank files' assembled
# tensors, and with every row checked the reference's out, lse, dq, dk, dv (the candidate's
# shapes): a copy of q, k, v, dout and the candidate made it hold them twice, and sampled rows
# allocated dk and dv of every key, in the reference and (outside the regime) in the bounds.
/usr/bin/python3 - "$LOOM" "$T/mem" <<'PY' || fail "the memory estimate against the peak resident set"
import os, re, shutil, subprocess, sys
import numpy as np
loom, d = sys.argv[1], sys.argv[2]
r = np.random.default_rng(5)
for i in ("in", "tiny/in", "big/in"):
    os.makedirs(f"{d}/{i}")
for n, h in (("q", 4), ("k", 2), ("v", 2), ("dout", 4)):
    x = r.standard_normal((4096, h, 32)).astype(np.float32)
    np.save(f"{d}/in/{n}.npy", x)
    np.save(f"{d}/tiny/in/{n}.npy", x[:16])
    np.save(f"{d}/big/in/{n}.npy", x * np.float32(40) if n == "q" else x)
for i in ("in", "tiny/in", "big/in"):
    subprocess.run([loom, "attn", "--input", f"{d}/{i}", "--backward", "--output",
                    f"{d}/{i}/../pass", "--iters", "1", "--warmup", "0", "--quiet"], check=True,
                   stdout=subprocess.DEVNULL)
os.makedirs(f"{d}/fail")
os.makedirs(f"{d}/pass_r")
for n in ("out", "lse", "dq", "dk", "dv"):
    x = np.load(f"{d}/pass/{n}.npy")
    np.save(f"{d}/fail/{n}.npy", x * np.float32(1.01) if n == "out" else x)
    S = x.shape[-1] if n == "lse" else x.shape[0]
    for k in range(4):  # contiguous
        rows = slice(k * S // 4, (k + 1) * S // 4)
        np.save(f"{d}/pass_r/{n}.rank{k}.npy", x[:, rows] if n == "lse" else x[rows])
time_ok = os.access("/usr/bin/time", os.X_OK)
if not time_ok:
    print("no /usr/bin/time: peaks include Python's, the held-data bound is not checked")

def peak_of(args):  # exit status, peak resident set in MiB
    if time_ok:
        e = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", f"{d}/time", loom, "verify"] + args)
        with open(f"{d}/time") as f:
            return e.returncode, int(f.read().split()[-1]) / 1024
    p = subprocess.Popen([loom, "verify"] + args)
    _, status, usage = os.wait4(p.pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss / 1024

def mib64(sub):  # the .npy files of d/sub in float64, MiB
    return sum(8 * np.load(f"{d}/{sub}/{f}", mmap_mode="r").size
               for f in os.listdir(f"{d}/{sub}") if f.endswith(".npy")) / 2**20

ok = True
base = peak_of(["--input", f"{d}/tiny/in", "--candidate", f"{d}/tiny/pass", "--quiet"])[1]
inputs, cand = mib64("in"), mib64("pass")
for ins, cand_dir, want, extra, held in (
        ("big/in", "big/pass", 0, ["--full-check-max", "1024"], inputs + cand),
        ("in", "pass", 0, ["--full-check-max", "1024"], inputs + cand),
        ("in", "pass_r", 0, ["--full-check-max", "1024", "--ranks", "4"], inputs + 2 * cand),
        ("in", "pass", 0, ["--full-check-max", "4096"], inputs + 2 * cand),
        ("in", "fail", 1, ["--full-check-max", "1024"], None),
        ("in", "fail", 1, ["--full-check-max", "4096"], None)):
    args = ["--input", f"{d}/{ins}", "--candidate", f"{d}/{cand_dir}", "--quiet"] + extra
    e = subprocess.run([loom, "verify"] + args + ["--memory-limit", "1"], capture_output=True,
                       text=True)
    m = re.search(r"needs about ([0-9.]+) MiB \(estimate\)", e.stderr)
    rc, peak = peak_of(args)
    est = float(m.group(1)) if m else float("nan")
    line = f"{cand_dir} {' '.join(extra)}: exit {rc}, peak {peak:.1f} MiB, estimate {est:.1f} MiB"
    good = rc == want and peak <= est <= 2 * peak
    if held is not None and time_ok:
        line += f", beyond a tiny run's {base:.1f} MiB {peak - base:.1f} MiB for {held:.1f} held"
        good = good and peak - base <= 1.25 * held
    print(line + ("" if good else "  <- FAIL"))
    ok = ok and good
sys.exit(0 if ok else 1)
PY

if [ $fails -ne 0 ]; then
  echo "$fails check(s) failed"
  exit 1
fi
echo "all loom verify checks passed"
