#!/usr/bin/env bash
# The README's second command: set up, build, and run the whole test suite:
#   1. build/ (Release): unit, local multi-rank, mpirun (label mpi: shared memory, and again over
#      TCP, label tcp, with a rank killed and a rank stopped), end-to-end tool tests, a ~35 s
#      random-fault soak (label soak) and bounded libFuzzer runs (label fuzz);
#   2. build-asan/: the unit and local multi-rank tests again under AddressSanitizer and
#      UndefinedBehaviorSanitizer;
#   3. build-aarch64/: the kernels cross-compiled for 64-bit Arm, their per-target tests run
#      under user-mode QEMU at four SVE vector lengths (label emulated, tests/emulated/).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --arm
jobs=$(nproc 2>/dev/null || echo 2)

(cd build && ctest --output-on-failure -j "$jobs")

sanitized=(test_core test_layout test_reference test_blockwise test_merge test_comm_local
           test_cp_local test_verify)
# -g1 (line tables) is all a sanitizer report needs for file:line stacks, and compiles ~40 %
# faster than full -g.
generator=()
[ -f build-asan/CMakeCache.txt ] || generator=(-G Ninja)  # as in setup.sh
cmake "${generator[@]}" -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOOM_SANITIZE=ON \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
  -DLOOM_WITH_MPI=OFF -DLOOM_WITH_TORCH=OFF -DLOOM_BUILD_BENCH=OFF > /dev/null
cmake --build build-asan -j "$jobs" --target "${sanitized[@]}"
# (test_blockwise runs as two gtest shards there: tests/kernels.cmake)
regex="^($(IFS='|'; echo "${sanitized[*]}"))(_shard[0-9]+)?\$"
# The 7- and 8-rank cases of test_cp_local ran in the Release pass; under the sanitizers they
# would double this pass's time for no new code paths.
(cd build-asan && GTEST_FILTER='-*_P7_*:*_P8_*' ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
   UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
   ctest --output-on-failure -j "$jobs" -R "$regex")

# 3. The Arm targets (NEON, SVE, SVE2, sve256, sve2_128), cross-compiled and emulated.
generator=()
[ -f build-aarch64/CMakeCache.txt ] || generator=(-G Ninja)
cmake "${generator[@]}" -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
  -DCMAKE_BUILD_TYPE=Release -DLOOM_KERNELS_ONLY=ON > /dev/null
cmake --build build-aarch64 -j "$jobs"
(cd build-aarch64 && ctest --output-on-failure -j "$jobs")
