#!/usr/bin/env bash
# C++ / CUDA format check: clang-format (style: .clang-format at the repository root) over every
# source under src/; fails listing the files it would change. With --fix, reformats them instead.
#   tools/format_check.sh [--fix]
# clang-format 23 is what the style was written for: pip install clang-format==23.1.5
set -euo pipefail
cd "$(dirname "$0")/.."
CLANG_FORMAT=${CLANG_FORMAT:-clang-format}
command -v "$CLANG_FORMAT" >/dev/null || { echo "format_check: $CLANG_FORMAT not found (pip install clang-format==23.1.5)" >&2; exit 2; }
mapfile -t files < <(git ls-files 'src/*.h' 'src/*.cpp' 'src/*.cu' 'src/*.cuh')
if [ "${1:-}" = "--fix" ]; then
  "$CLANG_FORMAT" -i --style=file "${files[@]}"
else
  "$CLANG_FORMAT" --dry-run --Werror --style=file "${files[@]}"
fi
