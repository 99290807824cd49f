#!/usr/bin/env bash
# Installs what loom needs from Debian's archive (idempotent: installs only what is missing),
# then configures and builds loom in build/ (Release).
#   --arm  also installs what the Arm cross build of the kernels needs (scripts/test.sh, step 3):
#          Debian's arm64 architecture (dpkg --add-architecture), the aarch64 cross compiler,
#          user-mode QEMU and the arm64 builds of Highway, GoogleTest and libgomp.
set -euo pipefail
cd "$(dirname "$0")/.."

arm=0
for a in "$@"; do
  case "$a" in
    --arm) arm=1 ;;
    *) echo "setup.sh: unknown option $a (accepted: --arm)" >&2; exit 2 ;;
  esac
done

sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
packages=(g++ cmake make libgtest-dev libcli11-dev nlohmann-json3-dev libopenmpi-dev openmpi-bin
          libopenblas-dev python3 python3-numpy bible-kjv clang libclang-rt-14-dev
          libhwy-dev pybind11-dev libtorch-dev python3-torch ninja-build)
if [ "$arm" -eq 1 ]; then
  packages+=(g++-aarch64-linux-gnu qemu-user-static libhwy-dev:arm64 libgtest-dev:arm64
             libgomp1:arm64)
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    echo "setup: adding Debian's arm64 architecture (dpkg --add-architecture arm64)"
    $sudo dpkg --add-architecture arm64
  fi
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  # The variable is set by env under sudo: sudo resets the environment, and one set before it
  # (DEBIAN_FRONTEND=... sudo apt-get) never reached apt-get, whose packages could then prompt.
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}"
fi

jobs=$(nproc 2>/dev/null || echo 2)
# Ninja compiles a target's sources while the libraries it links are still building (Make waits
# for them): on 2 cores a clean build took 297 s instead of 356 s, and the sanitized one in
# scripts/test.sh 319 s instead of 488 s. A build/ configured earlier keeps its own generator
# (CMake refuses to switch one).
generator=()
[ -f build/CMakeCache.txt ] || generator=(-G Ninja)
cmake "${generator[@]}" -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$jobs"

# The default corpus of `loom train`: the King James Bible, one verse per line (written once).
if [ ! -s data/kjv.txt ]; then
  mkdir -p data
  bible -f gen1:1-rev22:21 > data/kjv.txt.tmp && mv data/kjv.txt.tmp data/kjv.txt
fi

# loom.torch: /usr/bin/python3 (Debian's torch lives there) finds the package in build/python
# through one .pth file in its user site-packages naming that folder (docs/python.md). Written
# only when the build made the package; atomically, so a concurrent run never leaves half a file.
if [ -f build/python/loom/torch.py ] && [ -x /usr/bin/python3 ]; then
  site=$(/usr/bin/python3 -m site --user-site)
  mkdir -p "$site"
  printf '%s\n' "$(pwd)/build/python" > "$site/loom-build.pth.tmp.$$"
  mv "$site/loom-build.pth.tmp.$$" "$site/loom-build.pth"
fi
