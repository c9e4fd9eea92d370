#!/usr/bin/env bash
# Proves that a qformats wheel installs and works on a machine without a GPU. Two modes:
#
#   tools/wheel_check.sh [--out DIR]
#     builds the wheel itself, as a user without nvcc gets it, and checks it:
#     1. builds the wheel (pip's isolated build, QFORMATS_CUDA=AUTO as a user gets) with nvcc hidden:
#        every PATH folder holding nvcc is replaced by a copy of links without it, and
#        CUDACXX / CUDA_PATH / CUDA_HOME / QFORMATS_CUDA / CUDAARCHS are unset; the build log must
#        say "CUDA kernels OFF"; --out DIR keeps the wheel there (tools/build_wheel.sh uses this);
#     2. and 3. below, requiring a CPU-only build (tools/wheel_check.py --cpu-built).
#
#   tools/wheel_check.sh --wheel FILE [--cuda-built | --cpu-built]
#     checks a wheel built before (CI builds one CUDA wheel for every architecture and checks it
#     here, so that CUDA is compiled once): 2. and 3. only; the flag, passed on to
#     tools/wheel_check.py, requires that build kind (default: either, printed).
#
#  2. installs it into a fresh virtual environment with its dependencies only (numpy,
#     safetensors; no torch);
#  3. runs tools/wheel_check.py there, from outside the source tree: py.typed and the _native.pyi
#     stubs in the wheel, every module imports, cuda_available() is False (a CUDA-built wheel
#     must import and run its CPU paths without a GPU), each format's codec equals its
#     reference bytes and its CPU GEMM its float64 product.
# Environment: PYTHON=python3 (interpreter to build and test with), KEEP=1 keeps the work folder
# (printed), WORKDIR=... sets it.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
PY=$(command -v "${PYTHON:-python3}")
start=$(date +%s)
work=${WORKDIR:-$(mktemp -d "${TMPDIR:-/tmp}/qformats-wheel-check.XXXXXX")}
mkdir -p "$work"
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT
echo "wheel-check: work folder $work"

prebuilt="" out="" kind_flag=""
while [ $# -gt 0 ]; do
  case $1 in
    --wheel) [ -f "${2:-}" ] || { echo "wheel-check: no such wheel: ${2:-}" >&2; exit 2; }
             prebuilt=$(cd "$(dirname "$2")" && pwd)/$(basename "$2"); shift 2 ;;
    --out) mkdir -p "$2"; out=$(cd "$2" && pwd); shift 2 ;;
    --cuda-built | --cpu-built) kind_flag=$1; shift ;;
    *) echo "usage: $0 [--out DIR] | --wheel FILE [--cuda-built | --cpu-built]" >&2; exit 2 ;;
  esac
done
export PIP_DISABLE_PIP_VERSION_CHECK=1

# Every PATH folder holding nvcc is replaced by a folder of links to its other files.
hide_nvcc() {
  local newpath="" d f shadow
  IFS=: read -ra dirs <<< "$PATH"
  for d in "${dirs[@]}"; do
    [ -n "$d" ] || continue
    if [ -e "$d/nvcc" ]; then
      shadow="$work/path/$(printf '%s' "$d" | tr '/' '_')"
      mkdir -p "$shadow"
      for f in "$d"/* "$d"/.[!.]*; do
        [ -e "$f" ] || continue
        case "$(basename "$f")" in nvcc | nvcc.*) continue ;; esac
        ln -sf "$f" "$shadow/"
      done
      echo "wheel-check: hiding $d/nvcc"
      d=$shadow
    fi
    newpath="${newpath:+$newpath:}$d"
  done
  export PATH=$newpath
  unset CUDACXX CUDAHOSTCXX CUDA_PATH CUDA_HOME CUDA_ROOT CUDAToolkit_ROOT CMAKE_CUDA_COMPILER \
    QFORMATS_CUDA CUDAARCHS
  if command -v nvcc >/dev/null; then
    echo "wheel-check: nvcc still visible at $(command -v nvcc)" >&2
    exit 1
  fi
}

# --- 1. build (or take the prebuilt wheel) ----------------------------------------------------
if [ -n "$prebuilt" ]; then
  wheel=$prebuilt
  echo "wheel-check: prebuilt $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"
else
  hide_nvcc
  kind_flag=--cpu-built
  t0=$(date +%s)
  if ! "$PY" -m pip wheel "$repo" --no-deps -w "$work/dist" -v >"$work/build.log" 2>&1; then
    tail -40 "$work/build.log"
    echo "wheel-check: FAILED: pip wheel (log above)" >&2
    exit 1
  fi
  grep -m1 "qformats: CUDA kernels" "$work/build.log" | sed 's/^[ -]*/wheel-check: build: /'
  if ! grep -q "qformats: CUDA kernels OFF" "$work/build.log"; then
    echo "wheel-check: FAILED: the build did not report 'CUDA kernels OFF' with nvcc hidden" >&2
    exit 1
  fi
  wheel=$(ls "$work"/dist/qformats-*.whl)
  echo "wheel-check: built $(basename "$wheel") in $(( $(date +%s) - t0 )) s ($(du -h "$wheel" | cut -f1))"
  if [ -n "$out" ]; then
    cp "$wheel" "$out/"
    echo "wheel-check: wheel kept as $out/$(basename "$wheel")"
  fi
fi

# --- 2. fresh environment ---------------------------------------------------------------------
t0=$(date +%s)
"$PY" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$wheel"
echo "wheel-check: installed into a fresh venv in $(( $(date +%s) - t0 )) s"

# --- 3. checks --------------------------------------------------------------------------------
cd "$work"
"$work/venv/bin/python" -I "$repo/tools/wheel_check.py" "$wheel" $kind_flag
echo "wheel-check: done in $(( $(date +%s) - start )) s"
