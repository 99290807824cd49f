#!/bin/bash
# The docs' worked example (docs/verify.md): the seed-style PyTorch ring loop (tests/verify/
# seed_ring.py) is diagnosed as a missing log-sum-exp merge; its fixed version passes.
# Usage: seed_check.sh LOOM PYTHON
set -u
LOOM=$1
PY=$2
HERE=$(dirname "$0")
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
"$PY" "$HERE/seed_ring.py" "$T/seed" || exit 1
"$PY" "$HERE/seed_ring.py" "$T/fixed" --fixed || exit 1
V() { "$LOOM" verify --layout-dims BSHD --convention contiguous --ranks 4 "$@"; }
out=$(V --input "$T/seed/input" --candidate "$T/seed/candidate" 2>&1)
rc=$?
echo "$out"
[ $rc = 1 ] || { echo "FAIL: seed loop exit $rc, want 1"; exit 1; }
grep -q "^diagnosis missing log-sum-exp merge" <<<"$out" || { echo "FAIL: not diagnosed"; exit 1; }
out=$(V --input "$T/fixed/input" --candidate "$T/fixed/candidate" 2>&1)
rc=$?
echo "$out"
[ $rc = 0 ] || { echo "FAIL: fixed loop exit $rc, want 0"; exit 1; }
echo "seed loop diagnosed, fixed loop passes"
