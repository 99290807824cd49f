#!/usr/bin/env bash
# Scaling of every strategy and layout: one rank x T threads against P ranks x T threads on the
# same problem, forward + backward, measured in the same run (loom attn --baseline).
#   bench/scaling.sh [LOOM] [P] [S] [loom attn options...]
# Defaults: build/loom, P = 2, S = 8192, and, unless the options give their own, --heads 8
# --head-dim 128 --threads 1 --iters 1 --warmup 1 (causal: loom attn's default, --no-causal for
# full attention). Other loom attn options (--kv-heads, --dtype, --window...) pass through. The
# script sets --ranks (P), --seq (S), --strategy, --layout, --ulysses, --inner, --backward,
# --baseline, --quiet and --json itself: any of those among the options is refused.
# Prints one line per configuration: forward and backward times, efficiency E = T1 / (P * TP),
# balance (max/mean compute) and overlap (docs/cli.md), and writes JSON reports to $OUT_DIR
# (default: a temporary directory).
set -euo pipefail
loom="${1:-build/loom}"
P="${2:-2}"
S="${3:-8192}"
shift $(( $# > 3 ? 3 : $# ))
die() {
  echo "scaling.sh: $*" >&2
  exit 2
}
[[ "$P" =~ ^[1-9][0-9]*$ ]] || die "P must be a positive integer, got '$P'"
[[ "$S" =~ ^[1-9][0-9]*$ ]] || die "S must be a positive integer, got '$S'"
command -v "$loom" > /dev/null || die "$loom: not an executable file (the loom command: build/loom)"
# The defaults an option of the same name replaces (given twice, loom attn refused the run:
# "--head-dim: At Most 1 required but received 2").
declare -A defaults=([--heads]=8 [--head-dim]=128 [--threads]=1 [--iters]=1 [--warmup]=1)
for arg in "$@"; do
  name="${arg%%=*}"
  case "$name" in
    --ranks | --seq) die "$name is set by the script (give P and S as its arguments)" ;;
    --strategy | --layout | --ulysses | --inner | --backward | --baseline | --quiet | --json)
      die "$name is set by the script (it runs every strategy and layout, see its header)" ;;
  esac
  unset "defaults[$name]" 2> /dev/null || true
done
fixed=()
for name in "${!defaults[@]}"; do fixed+=("$name" "${defaults[$name]}"); done
out="${OUT_DIR:-$(mktemp -d)}"
mkdir -p "$out"
printf "%-10s %-11s %10s %10s %8s %8s %8s\n" strategy layout fwd_ms bwd_ms effic balance overlap
run() {
  local strategy="$1" layout="$2"; shift 2
  local json="$out/${strategy}_${layout}.json"
  "$loom" attn --ranks "$P" --strategy "$strategy" --layout "$layout" --seq "$S" \
    ${fixed[@]+"${fixed[@]}"} --backward --baseline --quiet --json "$json" "$@" > /dev/null
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
