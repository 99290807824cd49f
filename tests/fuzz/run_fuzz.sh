#!/usr/bin/env bash
# Builds a libFuzzer target with clang (AddressSanitizer + UndefinedBehaviorSanitizer) and runs it
# for a bounded time from the seed corpus. Usage: run_fuzz.sh npy|docs SECONDS
set -euo pipefail
name="$1"
seconds="${2:-20}"
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
case "$name" in
  npy) srcs=("$root/src/core/npy.cc" "$root/src/core/io.cc" "$root/src/core/tensor.cc"
        "$root/src/core/rng.cc") ;;
  docs) srcs=("$root/src/cp/layout.cc" "$root/src/core/tensor.cc") ;;
  *) echo "unknown fuzz target $name"; exit 2 ;;
esac
clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I"$root/include" "$root/tests/fuzz/fuzz_$name.cc" "${srcs[@]}" -o "$out/fuzz_$name"
mkdir -p "$out/corpus"
cp "$root/tests/fuzz/corpus/$name"/* "$out/corpus/"
rc=0
"$out/fuzz_$name" -max_total_time="$seconds" -rss_limit_mb=2048 -max_len=4096 \
  -print_final_stats=1 -artifact_prefix="$out/" "$out/corpus" > "$out/log" 2>&1 || rc=$?
if [ $rc -ne 0 ]; then
  grep -E "ERROR|runtime error|SUMMARY|^    #" "$out/log" | head -30
  for f in "$out"/crash-* "$out"/leak-* "$out"/timeout-* "$out"/oom-*; do
    [ -e "$f" ] && { echo "input $f:"; od -A x -t x1z "$f" | head -20; }
  done
  echo "fuzz_$name: FAILED (exit $rc)"
  exit 1
fi
grep -E "^Done|number_of_executed_units|new_units_added" "$out/log"
echo "fuzz_$name: 1 passed, 0 failed"
