#!/usr/bin/env bash
# Proves that `pip wheel .` needs no nvcc and that its wheel works on a machine without a GPU:
#  1. builds the wheel (pip's isolated build, QFORMATS_CUDA=AUTO as a user gets) with nvcc hidden:
#     every PATH folder holding nvcc is replaced by a copy of links without it, and
#     CUDACXX / CUDA_PATH / CUDA_HOME are unset; the build log must say "CUDA kernels OFF";
#  2. installs it into a fresh virtual environment with its dependencies only (numpy,
#     safetensors; no torch);
#  3. runs tools/wheel_check.py there, from outside the source tree: py.typed and the _native.pyi
#     stubs in the wheel, every module imports, cuda_available() is False, each format's codec
#     equals its reference bytes and its CPU GEMM its float64 product.
# Usage: tools/wheel_check.sh        PYTHON=python3 (interpreter to build and test with),
#                                    KEEP=1 keeps the work folder (printed), WORKDIR=... sets it
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
PY=$(command -v "${PYTHON:-python3}")
start=$(date +%s)
work=${WORKDIR:-$(mktemp -d "${TMPDIR:-/tmp}/qformats-wheel-check.XXXXXX")}
mkdir -p "$work"
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT
echo "wheel-check: work folder $work"

# --- hide nvcc --------------------------------------------------------------------------------
newpath=""
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
unset CUDACXX CUDAHOSTCXX CUDA_PATH CUDA_HOME CUDA_ROOT CUDAToolkit_ROOT CMAKE_CUDA_COMPILER
if command -v nvcc >/dev/null; then
  echo "wheel-check: nvcc still visible at $(command -v nvcc)" >&2
  exit 1
fi

# --- 1. build ---------------------------------------------------------------------------------
export PIP_DISABLE_PIP_VERSION_CHECK=1
t0=$(date +%s)
if ! "$PY" -m pip wheel "$repo" --no-deps -w "$work/dist" -v >"$work/build.log" 2>&1; then
  tail -40 "$work/build.log"
  echo "wheel-check: FAILED: pip wheel (log above)" >&2
  exit 1
fi
grep -m1 "qformats: CUDA kernels" "$work/build.log" | sed 's/^ */wheel-check: build: /'
if ! grep -q "qformats: CUDA kernels OFF" "$work/build.log"; then
  echo "wheel-check: FAILED: the build did not report 'CUDA kernels OFF' with nvcc hidden" >&2
  exit 1
fi
wheel=$(ls "$work"/dist/qformats-*.whl)
echo "wheel-check: built $(basename "$wheel") in $(( $(date +%s) - t0 )) s"

# --- 2. fresh environment ---------------------------------------------------------------------
t0=$(date +%s)
"$PY" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q "$wheel"
echo "wheel-check: installed into a fresh venv in $(( $(date +%s) - t0 )) s"

# --- 3. checks --------------------------------------------------------------------------------
cd "$work"
"$work/venv/bin/python" -I "$repo/tools/wheel_check.py" "$wheel"
echo "wheel-check: done in $(( $(date +%s) - start )) s"
