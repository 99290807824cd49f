#!/usr/bin/env bash
# `loom attn`'s memory estimate against the peak resident memory of the run it estimates, for
# every strategy forward and backward on the local backend, bf16, GQA, two kernel threads,
# --check, and --trace with --timeline: the peak must stay within the estimate (--memory-limit
# let through runs that exceeded it: ring --backward peaked at 1.5x its estimate), and the
# estimate within 1.6x the peak (so that it refuses only what would not fit). The estimate is the one the --memory-limit
# refusal prints; the peak is the child's maximum resident set (wait4).
# Usage: attn_memory_check.sh LOOM_BINARY
set -uo pipefail
loom="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/checks.sh"

# Four ranks, 4096 tokens, 4 heads of 64 (the process's own ~10 MiB stays a small part of the
# peak); two iterations, so that what grows from one to the next shows.
base=(attn --ranks 4 --seq 4096 --heads 4 --iters 1 --warmup 1 --quiet)
cases=(
  "--strategy ring"
  "--strategy ring --backward"
  "--strategy ring --layout stripe"
  "--strategy ring --layout stripe --backward"
  "--strategy allgather"
  "--strategy allgather --backward"
  "--strategy ulysses"
  "--strategy ulysses --backward"
  "--strategy hybrid --ulysses 2"
  "--strategy hybrid --ulysses 2 --backward"
  "--strategy ring2d --inner 2"
  "--strategy ring2d --inner 2 --backward"
  "--strategy ring --backward --dtype bf16"
  "--strategy allgather --backward --kv-heads 1"
  "--strategy hybrid --ulysses 2 --backward --threads 2"
  "--strategy ring --backward --check"
)
# Many ranks of a small problem: what each rank costs beyond its data (its thread, communicator
# and engine) dominates; counted as 1 MiB a rank, 128 ranks of 1024 tokens were estimated at
# 183.7 MiB for a 75 MiB peak (2.4x).
many=("--ranks 128 --seq 1024")
# --trace and --timeline with every rank at its 65,536 spans: the spans, their gather to rank 0
# and the two texts. They were counted nowhere, and rendered through a JSON document at about
# 1.5 KB a span: this run peaked at over 500 MB against an estimate of 14 MiB.
traced=("--ranks 4 --seq 256 --heads 1 --head-dim 16 --iters 4200 --warmup 0 --trace $work/t.json --timeline $work/t.svg")
runs=()
for c in "${cases[@]}"; do runs+=("${base[*]} $c"); done
for c in "${many[@]}"; do runs+=("attn $c --iters 1 --warmup 1 --quiet"); done
for c in "${traced[@]}"; do runs+=("attn $c --quiet"); done
for c in "${runs[@]}"; do
  # shellcheck disable=SC2206
  args=($c)
  if out=$(/usr/bin/python3 - "$loom" "${args[@]}" 2>&1 <<'PY'
import os, re, subprocess, sys
loom, args = sys.argv[1], sys.argv[2:]
r = subprocess.run([loom] + args + ["--memory-limit", "1"], capture_output=True, text=True,
                   timeout=60)
m = re.search(r"needs about ([0-9.]+) (B|KiB|MiB|GiB|TiB) \(estimate\)", r.stderr)
assert r.returncode == 1 and m, "no estimate in: " + r.stderr
est = float(m.group(1)) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(m.group(2))
p = subprocess.Popen([loom] + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
_, status, usage = os.wait4(p.pid, 0)
p.returncode = os.waitstatus_to_exitcode(status)
assert p.returncode == 0, "the run failed: " + p.stderr.read().decode()
peak = usage.ru_maxrss * 1024
print("estimate %.1f MiB, peak %.1f MiB (%.2fx)" % (est / 2**20, peak / 2**20, est / peak))
assert peak <= est, "the peak is above the estimate"
assert est <= 1.6 * peak, "the estimate is more than 1.6x the peak"
PY
  ); then ok "${c#attn }: $out"; else bad "${c#attn }: $out"; fi
done
summary
