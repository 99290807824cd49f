#!/usr/bin/env bash
# Scaling of every strategy and layout: one rank x T threads against P ranks x T threads on the
# same problem, forward + backward, measured in the same run (loom attn --baseline). ring,
# ulysses and allgather run in each layout (zigzag, contiguous, stripe); so do hybrid (Ulysses
# degree U inside groups, a ring across them) and ring2d (inner rings of I ranks, an outer ring
# across them), where P has a divisor strictly between 1 and P for their degree: at P = 2 or a
# prime P, hybrid would be ulysses or ring again and ring2d the ring, and they are not run (a
# line says so). ulysses and hybrid split the heads over their Ulysses degree (P, U): where the
# heads are not divisible by it, or the kv-heads and it do not divide one another, their rows
# read "not run: <why>" and the sweep goes on (at P = 3 with the default 8 heads ulysses is not
# run; it stopped the sweep, allgather, hybrid and ring2d never ran).
#   bench/scaling.sh [LOOM] [P] [S] [--ulysses U] [--inner I] [loom attn options...]
# Defaults: build/loom, P = 2, S = 8192, U and I the smallest divisor of P above 1 (2 for even
# P >= 4), and, unless the options give their own, --heads 8 --head-dim 128 --threads 1 --iters 1
# --warmup 1 (causal: loom attn's default, --no-causal for full attention). --ulysses U and
# --inner I set hybrid's and ring2d's degree (a divisor of P strictly between 1 and P); every
# other loom attn option (--kv-heads, --dtype, --window...) passes through to every run. The
# script sets --ranks (P), --seq (S), --strategy, --layout, --backward, --baseline, --quiet and
# --json itself: any of those among the options is refused.
# Prints one line per configuration: forward and backward times, efficiency E = T1 / (P * TP),
# balance (max/mean compute) and overlap (docs/cli.md), and writes JSON reports to $OUT_DIR
# (default: a temporary directory).
# Exit status: 0 when every row ran or says why it was not run; 2, with one line, for a bad
# argument (the script's before anything runs; one loom attn refuses, with loom's own line, at
# the first run, before the table's header); 1 when a loom run fails (its own error line above;
# the sweep stops there) or exits 0 without writing its report (--help passed through printed
# the previous run's numbers as this one's).
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
# The degree of hybrid (--ulysses) and ring2d (--inner): the smallest divisor of P above 1 and
# below P, none where P has no such divisor.
degree=""
for ((d = 2; d * d <= P; d++)); do
  if ((P % d == 0)); then
    degree=$d
    break
  fi
done
ulysses="$degree" inner="$degree"
# Checks a --ulysses / --inner value: a divisor of P strictly between 1 and P (a degree of 1 or P
# runs the plain ring or Ulysses again; one that does not divide P, loom refuses mid-script).
degree_of() {
  local name="$1" value="$2"
  if ! [[ "$value" =~ ^[1-9][0-9]{0,8}$ ]] || ((value < 2 || value >= P || P % value != 0)); then
    die "$name '$value' must divide P = $P and lie strictly between 1 and P (it is the degree of $3)"
  fi
  echo "$value"
}
# The defaults an option of the same name replaces (given twice, loom attn refused the run:
# "--head-dim: At Most 1 required but received 2").
declare -A defaults=([--heads]=8 [--head-dim]=128 [--threads]=1 [--iters]=1 [--warmup]=1)
pass=()
while (($# > 0)); do
  arg="$1"
  shift
  name="${arg%%=*}"
  case "$name" in
    --ranks | --seq) die "$name is set by the script (give P and S as its arguments)" ;;
    --strategy | --layout | --backward | --baseline | --quiet | --json)
      die "$name is set by the script (it runs every strategy and layout, see its header)" ;;
    -h | --help | --version) die "$name is not for a sweep (loom attn $name runs nothing)" ;;
    --ulysses | --inner)
      if [[ "$arg" == *=* ]]; then
        value="${arg#*=}"
      else
        (($# > 0)) || die "$name needs a value (a divisor of P = $P strictly between 1 and P)"
        value="$1"
        shift
      fi
      if [ "$name" = --ulysses ]; then
        ulysses=$(degree_of --ulysses "$value" "hybrid's Ulysses groups")
      else
        inner=$(degree_of --inner "$value" "ring2d's inner rings")
      fi
      continue
      ;;
  esac
  unset "defaults[$name]" 2> /dev/null || true
  pass+=("$arg")
done
set -- ${pass[@]+"${pass[@]}"}
# The heads and kv-heads loom attn gets (the defaults' or the options'), for the strategies that
# split the heads over their Ulysses degree.
opt_value() {
  local name="$1" value="$2" i
  for ((i = 0; i < ${#pass[@]}; i++)); do
    case "${pass[i]}" in
      "$name") value="${pass[i + 1]:-}" ;;
      "$name"=*) value="${pass[i]#*=}" ;;
    esac
  done
  echo "$value"
}
heads=$(opt_value --heads 8)
kv_heads=$(opt_value --kv-heads "$heads")
# Why heads split over Ulysses degree $1 cannot run, as loom would refuse them ('' where they can;
# also where the values are not plain integers: loom refuses those at the first row, which stops
# the sweep with its own line).
heads_reason() {
  local U="$1"
  [[ "$heads" =~ ^[1-9][0-9]{0,8}$ && "$kv_heads" =~ ^[1-9][0-9]{0,8}$ ]] || return 0
  if ((heads % U != 0)); then
    echo "heads ($heads) must be divisible by the ulysses degree ($U)"
  elif ((kv_heads % U != 0 && U % kv_heads != 0)); then
    echo "kv-heads ($kv_heads) and the ulysses degree ($U) must divide one another"
  fi
}
fixed=()
for name in "${!defaults[@]}"; do fixed+=("$name" "${defaults[$name]}"); done
out="${OUT_DIR:-$(mktemp -d)}"
mkdir -p "$out"
# The table's header, printed before the first row (a loom attn that refuses the options at the
# first run then prints its line alone).
header=1
print_header() {
  if ((header)); then
    printf "%-10s %-11s %10s %10s %8s %8s %8s\n" strategy layout fwd_ms bwd_ms effic balance overlap
    header=0
  fi
}
run() {
  local strategy="$1" layout="$2" label="$1"; shift 2
  local why=""
  case "$strategy" in
    ulysses) why=$(heads_reason "$P") ;;
    hybrid)
      label="hybrid/U$ulysses"
      set -- --ulysses "$ulysses" "$@"
      why=$(heads_reason "$ulysses")
      ;;
    ring2d) label="ring2d/I$inner"; set -- --inner "$inner" "$@" ;;
  esac
  if [ -n "$why" ]; then
    print_header
    printf "%-10s %-11s not run: %s\n" "$label" "$layout" "$why"
    return 0
  fi
  local json="$out/${strategy}_${layout}.json" rc=0
  rm -f "$json"  # a report left by an earlier sweep in $OUT_DIR is never read as this run's
  "$loom" attn --ranks "$P" --strategy "$strategy" --layout "$layout" --seq "$S" \
    ${fixed[@]+"${fixed[@]}"} --backward --baseline --quiet --json "$json" "$@" > /dev/null || rc=$?
  if ((rc != 0)); then
    ((rc == 2 && header)) && exit 2  # loom refused the options (its line above), before any row
    exit 1
  fi
  [ -s "$json" ] || {
    echo "scaling.sh: loom attn ($label, $layout) exited 0 without writing its report $json" >&2
    exit 1
  }
  print_header
  /usr/bin/python3 - "$json" "$label" "$layout" <<'PY'
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
if [ -n "$degree" ]; then
  for layout in zigzag contiguous stripe; do
    run hybrid "$layout" "$@"
    run ring2d "$layout" "$@"
  done
else
  print_header
  echo "hybrid, ring2d: not run (P = $P has no divisor strictly between 1 and P for their degree)"
fi
echo "reports: $out"
