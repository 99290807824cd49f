#!/usr/bin/env bash
# `loom attn --input/--output` against the independent NumPy float64 implementation, for the
# configurations the context-parallel issue names. Usage: output_check.sh LOOM_BINARY
set -euo pipefail
loom="$1"
here="$(cd "$(dirname "$0")" && pwd)"
py=/usr/bin/python3
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
tol=2e-5
n=0
# run NAME "MAKE-ARGS" "LOOM-ARGS" "CHECK-ARGS"
run() {
  local name="$1" make="$2" args="$3" check="$4"
  mkdir -p "$work/$name/in" "$work/$name/out"
  $py "$here/npy_attention.py" make "$work/$name/in" $make
  "$loom" attn --input "$work/$name/in" --output "$work/$name/out" --backward --iters 1 \
    --warmup 0 $args > "$work/$name/log" 2>&1 || { cat "$work/$name/log"; echo "FAILED: $name (loom)"; exit 1; }
  if ! $py "$here/npy_attention.py" check "$work/$name/in" "$work/$name/out" --backward \
      --tol $tol $check > "$work/$name/check" 2>&1; then
    cat "$work/$name/check"; echo "FAILED: $name"; exit 1
  fi
  echo "ok   $name: $(tail -1 "$work/$name/check")"
  n=$((n + 1))
}
shape="--seq 96 --heads 4 --kv-heads 2 --head-dim 16"
mha="--seq 96 --heads 4 --kv-heads 4 --head-dim 16"
run ring_contiguous_causal "$shape" "--ranks 4 --strategy ring --layout contiguous" ""
run ring_zigzag_causal     "$shape" "--ranks 4 --strategy ring --layout zigzag" ""
run ring_stripe_causal     "$shape" "--ranks 4 --strategy ring --layout stripe" ""
run ring_zigzag_full       "$shape" "--ranks 4 --no-causal" "--no-causal"
run ring_zigzag_mha        "$mha"   "--ranks 2" ""
run ring_zigzag_window     "$shape" "--ranks 4 --window 11" "--window 11"
run ring_zigzag_docs       "$shape" "--ranks 4 --docs 40,7,49" "--docs 40,7,49"
run ring_stripe_docs_window "$shape" "--ranks 3 --layout stripe --docs 50,46 --window 9" "--docs 50,46 --window 9"
run ring_odd_p3            "--seq 97 --heads 4 --kv-heads 2 --head-dim 16" "--ranks 3" ""
run ring_odd_p7            "--seq 97 --heads 4 --kv-heads 2 --head-dim 16" "--ranks 7" ""
run ulysses_scatter_kv     "--seq 96 --heads 8 --kv-heads 4 --head-dim 16" "--ranks 4 --strategy ulysses" ""
run ulysses_replicate_kv   "--seq 96 --heads 8 --kv-heads 2 --head-dim 16" "--ranks 4 --strategy ulysses" ""
run ulysses_odd_p3         "--seq 97 --heads 6 --kv-heads 3 --head-dim 16" "--ranks 3 --strategy ulysses --layout stripe" ""
run hybrid_2x2             "--seq 96 --heads 8 --kv-heads 2 --head-dim 16" "--ranks 4 --strategy hybrid --ulysses 2" ""
run hybrid_2x4             "--seq 96 --heads 8 --kv-heads 2 --head-dim 16" "--ranks 8 --strategy hybrid --ulysses 2" ""
run hybrid_4x2             "--seq 96 --heads 8 --kv-heads 2 --head-dim 16" "--ranks 8 --strategy hybrid --ulysses 4 --docs 30,66" "--docs 30,66"
run allgather_zigzag       "$shape" "--ranks 4 --strategy allgather" ""
run allgather_odd_p7       "--seq 97 --heads 4 --kv-heads 1 --head-dim 16" "--ranks 7 --strategy allgather --window 20" "--window 20"
run single_rank_window     "$shape" "--ranks 1 --window 5" "--window 5"
echo "$n passed, 0 failed"
