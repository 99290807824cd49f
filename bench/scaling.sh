#!/usr/bin/env bash
# Scaling of every strategy and layout: one rank x T threads against P ranks x T threads on the
# same problem, forward + backward, measured in the same run (loom attn --baseline).
#   bench/scaling.sh [LOOM] [P] [S] [extra loom options...]
# Defaults: build/loom, P = 2, S = 8192, H = 8, D = 128, causal, 1 thread per rank.
# Prints one line per configuration: forward and backward times, efficiency E = T1 / (P * TP),
# balance (max/mean compute) and overlap (docs/cli.md), and writes JSON reports to $OUT_DIR
# (default: a temporary directory).
set -euo pipefail
loom="${1:-build/loom}"
P="${2:-2}"
S="${3:-8192}"
shift $(( $# > 3 ? 3 : $# ))
out="${OUT_DIR:-$(mktemp -d)}"
mkdir -p "$out"
printf "%-10s %-11s %10s %10s %8s %8s %8s\n" strategy layout fwd_ms bwd_ms effic balance overlap
run() {
  local strategy="$1" layout="$2"; shift 2
  local json="$out/${strategy}_${layout}.json"
  "$loom" attn --ranks "$P" --threads 1 --strategy "$strategy" --layout "$layout" --seq "$S" \
    --heads 8 --head-dim 128 --backward --iters 1 --warmup 1 --baseline --quiet \
    --json "$json" "$@" > /dev/null
  /usr/bin/python3 - "$json" "$strategy" "$layout" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("%-10s %-11s %10.1f %10.1f %8.3f %8.3f %8.3f" % (sys.argv[2], sys.argv[3],
      r["forward_s"] * 1e3, r["backward_s"] * 1e3, r["efficiency"], r["balance"], r["overlap"]))
PY
}
for layout in zigzag contiguous stripe; do
  run ring "$layout" "$@"
done
for layout in zigzag contiguous stripe; do
  run ulysses "$layout" "$@"
  run allgather "$layout" "$@"
done
if [ "$P" -ge 4 ] && [ $((P % 2)) -eq 0 ]; then
  run hybrid zigzag --ulysses 2 "$@"
fi
echo "reports: $out"
