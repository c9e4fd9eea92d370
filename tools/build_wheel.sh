#!/usr/bin/env bash
# Builds one wheel of qformats for this machine's Python and smoke-tests it in a fresh virtual
# environment without torch or a GPU (tools/wheel_check.sh -> tools/wheel_check.py):
#
#   tools/build_wheel.sh [-o DIR]          CPU wheel: built with nvcc hidden, as a machine without
#                                          CUDA builds it (QFORMATS_CUDA=AUTO, "CUDA kernels OFF")
#   tools/build_wheel.sh --cuda [-o DIR]   CUDA wheel: QFORMATS_CUDA=ON, every architecture of
#                                          CMakeLists.txt's QFORMATS_ALL_CUDA_ARCHS that nvcc
#                                          lists (CUDAARCHS=... narrows it); the check requires a
#                                          CUDA build that imports and runs its CPU paths without
#                                          a GPU
#
# The wheel lands in DIR (default dist/); the build log of a CUDA wheel in DIR/build-cuda.log.
# PYTHON=python3.X picks the interpreter (the wheel is for that Python). These are wheels for
# this machine (linux_x86_64 tag); manylinux wheels for every supported Python come from
# cibuildwheel ([tool.cibuildwheel] in pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
PY=$(command -v "${PYTHON:-python3}")
cuda=0 out=dist
while [ $# -gt 0 ]; do
  case $1 in
    --cuda) cuda=1; shift ;;
    -o | --out) out=$2; shift 2 ;;
    *) echo "usage: $0 [--cuda] [-o DIR]" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$(date +%s)

if [ $cuda = 0 ]; then
  tools/wheel_check.sh --out "$out"
  echo "build-wheel: done in $(( $(date +%s) - start )) s"
  exit 0
fi

command -v nvcc >/dev/null || [ -n "${CUDACXX:-}" ] || {
  echo "build-wheel: --cuda needs nvcc on the PATH (or CUDACXX)" >&2; exit 1; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/qformats-build-wheel.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
log=$out/build-cuda.log
echo "build-wheel: CUDA wheel, nvcc $(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p'), log $log"
t0=$(date +%s)
if ! QFORMATS_CUDA=ON PIP_DISABLE_PIP_VERSION_CHECK=1 \
    "$PY" -m pip wheel "$repo" --no-deps -w "$tmp" -v >"$log" 2>&1; then
  tail -40 "$log"
  echo "build-wheel: FAILED: pip wheel (log above)" >&2
  exit 1
fi
grep -m1 "qformats: CUDA kernels" "$log" | sed 's/^[ -]*/build-wheel: /'
grep -q "qformats: CUDA kernels ON" "$log" || {
  echo "build-wheel: FAILED: the build did not report 'CUDA kernels ON'" >&2; exit 1; }
ncu=$(grep -c "Building CUDA object" "$log" || true)
wheel=$(ls "$tmp"/qformats-*.whl)
mv "$wheel" "$out/"
wheel=$out/$(basename "$wheel")
echo "build-wheel: built $(basename "$wheel") in $(( $(date +%s) - t0 )) s ($ncu CUDA sources compiled; $(du -h "$wheel" | cut -f1))"
tools/wheel_check.sh --wheel "$wheel" --cuda-built
echo "build-wheel: done in $(( $(date +%s) - start )) s"
