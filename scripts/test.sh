#!/usr/bin/env bash
# The README's second command: set up, build, and run the whole test suite (unit, local
# multi-rank and mpirun tests).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cd build
ctest --output-on-failure -j "$(nproc 2>/dev/null || echo 2)"
