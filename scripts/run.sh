#!/usr/bin/env bash
# The README's first command: set up, build, and run loom's main job — a 4-rank zigzag ring
# attention, forward and backward, checked against the fp64 reference.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build/loom attn --ranks 4 --strategy ring --layout zigzag --seq 2048 --heads 8 --kv-heads 2 \
  --head-dim 64 --backward --check
