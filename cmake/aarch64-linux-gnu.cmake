# Cross-compiles loom's kernels for 64-bit Arm with Debian's g++-aarch64-linux-gnu and runs their
# tests under user-mode QEMU (qemu-user-static), so the Arm kernel targets (NEON, SVE, SVE2 and
# the fixed-length sve256 and sve2_128) are built and tested on an x86-64 machine. Used with
# -DLOOM_KERNELS_ONLY=ON (the rest of loom needs Arm builds of MPI, BLAS and torch): scripts/test.sh,
# step 3, and tests/emulated/ for what runs at which SVE length.
#
# Arm libraries come from Debian's arm64 multiarch packages (libhwy-dev:arm64, libgtest-dev:arm64,
# libgomp1:arm64) in /usr/lib/aarch64-linux-gnu, where QEMU's guest loader finds them; header-only
# packages are shared with the host. QEMU runs without -L /usr/aarch64-linux-gnu: with the cross
# toolchain's own copy of the C library as the guest's root, QEMU 7.2 hung in every program that
# started a thread (a two-thread OpenMP loop or a std::thread), not so with the multiarch one.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64-static)
