#!/usr/bin/env bash
# Run lar's test suites (what CI runs): unit and integration tests, then the Slurm
# tests on a local single-node cluster started for the purpose. GPU tests are compiled
# (when nvcc exists) but run only on a GPU machine: ctest --test-dir build -L gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
LAR_WERROR=${LAR_WERROR:-ON} scripts/setup.sh
# The dashboard's end-to-end test drives Debian's headless Chromium (tests/serve/).
if ! command -v chromium >/dev/null 2>&1; then
  echo "test: installing chromium (for the lar serve end-to-end test)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
ctest --test-dir build -L 'unit|integration' -j 2 --output-on-failure --timeout 900
if [ -x tests/slurm/cluster.sh ] && [ -n "$(ctest --test-dir build -L slurm -N | grep -E 'Total Tests: [1-9]')" ]; then
  tests/slurm/cluster.sh start
  trap 'tests/slurm/cluster.sh stop' EXIT
  ctest --test-dir build -L slurm --output-on-failure --timeout 900
fi
