#!/usr/bin/env bash
# Development build without installing: compiles the given formats (default: all) into
# build/dev-<tag>/ and writes each extension (and its _native.pyi type stub, made by the build)
# next to its Python package, so that
#   PYTHONPATH=python python -m pytest tests/<fmt>
# runs against the fresh build. Separate tags let several formats build side by side.
#   tools/dev_build.sh [fmt ...]        QFORMATS_CUDA=ON|OFF|AUTO (default OFF here)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
fmts="$*"
tag=${fmts:-all}; tag=${tag// /-}
cmake -S . -B "build/dev-$tag" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DQFORMATS_FORMATS="${fmts// /;}" -DQFORMATS_CUDA="${QFORMATS_CUDA:-OFF}" -DQFORMATS_DEV_INPLACE=ON \
  -DPython_EXECUTABLE="$(command -v "$PY")" >/dev/null
cmake --build "build/dev-$tag" -j "${JOBS:-2}"
