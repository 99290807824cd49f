#!/usr/bin/env bash
# `loom attn`'s outputs and limits where a run used to fail only at its end, hang, or end in
# another library's abort: a FIFO whose reader stops reading (the write waited for ever), kernel
# threads under an address-space limit (libgomp's "Thread creation failed" instead of loom's
# refusal), and, as root, an --output directory or a report that is a mount point (refused only
# after the run, other outputs already replaced), a read-only --output directory of the user who
# runs loom (refused after the run), and an old set that cannot be removed (left without a word).
# Usage: output_guard_check.sh LOOM_BINARY
set -uo pipefail
loom="$1"
work="$(mktemp -d)"
mounted=()
cleanup() {
  local m
  for m in "${mounted[@]}"; do umount "$m" 2> /dev/null; done
  chmod -R u+rwx "$work" 2> /dev/null
  rm -rf "$work"
}
trap cleanup EXIT
source "$(dirname "$0")/checks.sh"
small=(attn --seq 128 --heads 2 --head-dim 16 --iters 1 --warmup 0 --quiet)

# 1. A FIFO whose reader opened it and never reads: the write times out after LOOM_TIMEOUT_S with
#    one line (it blocked for ever: `timeout` ended it, exit 124).
mkfifo "$work/ff"
(exec 3< "$work/ff"; exec sleep 30) &
reader=$!
sleep 0.2
start=$(date +%s)
LOOM_TIMEOUT_S=1 timeout 25 "$loom" attn --seq 2048 --heads 4 --head-dim 16 --ranks 4 --iters 20 \
  --quiet --trace "$work/ff" > /dev/null 2> "$work/stderr"
rc=$?
took=$(( $(date +%s) - start ))
kill "$reader" 2> /dev/null; wait "$reader" 2> /dev/null
[ $rc -eq 1 ] && [ "$(wc -l < "$work/stderr")" -eq 1 ] && [ "$took" -le 15 ] &&
  grep -qF "$work/ff: write timed out: its reader took nothing for 1 s (LOOM_TIMEOUT_S)" \
    "$work/stderr" && ok "--trace into a FIFO nobody reads: $(cat "$work/stderr")" ||
  { cat "$work/stderr"; bad "--trace into a FIFO nobody reads (rc=$rc, ${took} s)"; }

# 2. Under an address-space limit the kernel threads' stacks (the stack limit each) and malloc
#    arenas count: 2 ranks of 256 threads map 4 GiB of stacks alone, and ended in libgomp's abort
#    ("libgomp: Thread creation failed", exit 1, no loom line). Refused before the run; a run
#    with few threads under the same limit goes through.
limited() {  # limited ARGS...: loom under ulimit -v 3000000 (2.86 GiB) and -s 8192
  OPENBLAS_NUM_THREADS=1 bash -c 'ulimit -s 8192; ulimit -v 3000000; exec "$0" "$@"' "$loom" "$@"
}
limited attn --seq 1024 --ranks 2 --threads 256 --iters 1 --warmup 0 --quiet \
  > "$work/stdout" 2> "$work/stderr"
rc=$?
[ $rc -eq 1 ] && [ "$(wc -l < "$work/stderr")" -eq 1 ] && [ ! -s "$work/stdout" ] &&
  grep -qF "of address space (estimate) but the address-space limit (ulimit -v) of 2.86 GiB" \
    "$work/stderr" &&
  grep -qF "for the stacks and malloc arenas of its 512 threads" "$work/stderr" &&
  ok "256 threads a rank under ulimit -v: $(cat "$work/stderr")" ||
  { cat "$work/stderr"; bad "256 threads a rank under ulimit -v (rc=$rc)"; }
limited attn --seq 1024 --ranks 2 --threads 4 --iters 1 --warmup 0 --quiet > /dev/null \
  2> "$work/stderr" && ok "4 threads a rank under the same limit run" ||
  { cat "$work/stderr"; bad "4 threads a rank under ulimit -v"; }

# 3. An output marked immutable or append-only (chattr +i, +a): the rename over it failed with
#    EPERM after the whole run (and after --json was written beside an --output that then failed).
#    Refused before the run now, the other outputs untouched. Needs root and a file system that
#    keeps the flags (ext4, xfs, btrfs).
echo old > "$work/imm.json"
"$loom" "${small[@]}" --output "$work/iset" > /dev/null 2>&1
if [ "$(id -u)" -eq 0 ] && chattr +i "$work/imm.json" 2> /dev/null; then
  for c in "imm.json:+i:immutable (chattr +i)" "imm.json:+a:append-only (chattr +a)" \
           "iset:+i:immutable (chattr +i)"; do
    IFS=: read -r name flag what <<< "$c"
    chattr -i -a "$work/imm.json" "$work/iset"
    chattr "$flag" "$work/$name"
    echo before > "$work/side.json"
    if [ "$name" = iset ]; then out=(--output "$work/iset" --json "$work/side.json"); shown="--output $work/iset"
    else out=(--json "$work/imm.json" --trace "$work/side.json"); shown="--json $work/imm.json"; fi
    "$loom" "${small[@]}" --seed 3 "${out[@]}" > /dev/null 2> "$work/stderr"
    rc=$?
    [ $rc -ne 0 ] && [ "$(wc -l < "$work/stderr")" -eq 1 ] && [ "$(cat "$work/side.json")" = before ] &&
      grep -qF "loom: error: $shown: is $what, so loom cannot replace it" "$work/stderr" &&
      ok "$name $flag refused before the run: $(cat "$work/stderr")" ||
      { cat "$work/stderr"; bad "$name $flag (rc=$rc)"; }
  done
  chattr -i -a "$work/imm.json" "$work/iset"
else
  echo "skip: chattr +i needs root and a file system with the flags; the immutable-output checks did not run"
fi

nobody=(setpriv --reuid=65534 --regid=65534 --clear-groups)
if [ "$(id -u)" -ne 0 ] || ! command -v setpriv > /dev/null ||
   ! "${nobody[@]}" test -x "$loom" || ! mkdir "$work/mp" ||
   ! mount -t tmpfs tmpfs "$work/mp" 2> /dev/null; then
  echo "note: the mount-point and other-user checks need root, mount and setpriv; not run"
  summary
  exit
fi
mounted+=("$work/mp")

# 4. Mount points: a rename onto one fails (EBUSY). --output onto a mounted tmpfs ran the whole
#    job, replaced --json's old.json, then failed; --trace onto a bind-mounted file wrote --json
#    first. Both are refused before the run now, nothing written; a directory inside the mount
#    is fine.
echo old > "$work/old.json"
"$loom" "${small[@]}" --output "$work/mp" --json "$work/old.json" > "$work/stdout" \
  2> "$work/stderr"
rc=$?
[ $rc -eq 1 ] && [ "$(wc -l < "$work/stderr")" -eq 1 ] && [ ! -s "$work/stdout" ] &&
  [ "$(cat "$work/old.json")" = old ] &&
  grep -qF "loom: error: --output $work/mp: is a mount point" "$work/stderr" &&
  grep -qF "name a directory inside it, e.g. $work/mp/set" "$work/stderr" &&
  ok "--output onto a mount point refused before the run: $(cat "$work/stderr")" ||
  { cat "$work/stderr"; bad "--output onto a mount point (rc=$rc)"; }
"$loom" "${small[@]}" --output "$work/mp/set" > /dev/null 2> "$work/stderr" &&
  [ -f "$work/mp/set/out.npy" ] && ok "--output inside the mount point" ||
  { cat "$work/stderr"; bad "--output inside the mount point"; }
echo precious > "$work/src.json"
: > "$work/bm.json"
mount --bind "$work/src.json" "$work/bm.json" && mounted=("$work/bm.json" "${mounted[@]}")
"$loom" "${small[@]}" --json "$work/a.json" --trace "$work/bm.json" > "$work/stdout" \
  2> "$work/stderr"
rc=$?
[ $rc -eq 1 ] && [ "$(wc -l < "$work/stderr")" -eq 1 ] && [ ! -s "$work/stdout" ] &&
  [ ! -e "$work/a.json" ] && [ "$(cat "$work/bm.json")" = precious ] &&
  grep -qF "loom: error: --trace $work/bm.json: is a mount point" "$work/stderr" &&
  ok "--trace onto a bind-mounted file refused before the run, --json not written" ||
  { cat "$work/stderr"; bad "--trace onto a bind-mounted file (rc=$rc)"; }

# 5. A read-only --output directory (0555) of the user who runs loom: its bits went onto the
#    staging directory before the files were written, and the run failed at its end ("cannot
#    write (Permission denied)"). Replaced now, keeping 0555.
chmod 777 "$work"
"${nobody[@]}" mkdir "$work/u"
"${nobody[@]}" "$loom" "${small[@]}" --output "$work/u/set" > /dev/null 2>&1
"${nobody[@]}" chmod 555 "$work/u/set"
before=$(stat -c %i "$work/u/set/out.npy")
"${nobody[@]}" "$loom" "${small[@]}" --seed 2 --output "$work/u/set" > /dev/null 2> "$work/stderr"
rc=$?
[ $rc -eq 0 ] && [ ! -s "$work/stderr" ] && [ "$(stat -c %a "$work/u/set")" = 555 ] &&
  [ "$(stat -c %i "$work/u/set/out.npy")" != "$before" ] && [ "$(ls "$work/u")" = set ] &&
  ok "a read-only --output directory of its owner is replaced, still 0555" ||
  { cat "$work/stderr"; ls -la "$work/u"; bad "read-only --output directory (rc=$rc)"; }

# 6. The old set holds another user's files, which only that user may delete: the new set is
#    swapped in (exit 0) and the old one stays as DIR.tmp.PID-N, now named on stderr (it stayed
#    without a word).
rm -rf "$work/u/other"
"$loom" "${small[@]}" --output "$work/u/other" > /dev/null 2>&1  # root's set
"${nobody[@]}" "$loom" "${small[@]}" --output "$work/u/other" > /dev/null 2> "$work/stderr"
rc=$?
left=$(cd "$work/u" && ls -d other.tmp.* 2> /dev/null)
[ $rc -eq 0 ] && [ "$(wc -l < "$work/stderr")" -eq 1 ] && [ -n "$left" ] &&
  [ "$(stat -c %U "$work/u/other/out.npy")" = nobody ] &&
  grep -qF "loom attn: warning: --output $work/u/other: the new set is in place, but the old one could not be removed (Permission denied) and is left in $work/u/$left; remove it yourself" \
    "$work/stderr" && ok "an old set that cannot be removed is named: $(cat "$work/stderr")" ||
  { cat "$work/stderr"; ls -la "$work/u"; bad "an old set that cannot be removed (rc=$rc)"; }

summary
