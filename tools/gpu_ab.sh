#!/usr/bin/env bash
# A change against its base in one GPU call: same machine, same clocks, no experiment switch in the
# code. Put the base's source tree in ab/base first (ignored by git; name it in the device tool's
# carry), for example
#   rm -rf ab/base && mkdir -p ab/base && git archive BASE_REV | tar -x -C ab/base
# then run on the GPU machine, from the repository root:
#   tools/gpu_ab.sh [-r ROUNDS] -- COMMAND [ARGS...]
# Both trees are built side by side (pip --target into their own directories, their own build
# directories), then COMMAND runs ROUNDS times (default 2) under each, alternating, base first, with
# PYTHONPATH pointing at the build under test. Its output lines are prefixed "base|" or "head|" and
# kept in $OUT/ab-base.txt and $OUT/ab-head.txt (each round after a "=== round N" line); the build
# logs stay in $TMPDIR unless a build fails. Two files, since the device tool brings back at most
# 8 from $OUT. COMMAND runs in this (the head's) tree, so a benchmark script is the head's in both
# runs. QF_FORMATS (as in gpu_check.sh, e.g. "mixed2bit;int4") builds only those formats: enough for
# their tests, not for the benchmarks, which import every format.
set -uo pipefail
rounds=2
while [ $# -gt 0 ]; do
  case $1 in
    -r) rounds=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: tools/gpu_ab.sh [-r ROUNDS] -- COMMAND [ARGS...]" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] && [ -f ab/base/pyproject.toml ] || { echo "gpu_ab: need a command and ab/base/pyproject.toml" >&2; exit 2; }
OUT=${OUT:-/tmp/qformats-ab}
TMP=${TMPDIR:-/tmp}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. "$(dirname "$0")/carried_wheels.sh"
site=${PYTHONPATH:-}
build() {  # build NAME SRC
  python3 -m pip install --no-build-isolation --no-deps -v --target "$TMP/qf-$1" --upgrade "$2" \
    "-Cbuild-dir=$TMP/qf-build-$1" "-Ccmake.define.QFORMATS_FORMATS=${QF_FORMATS:-}" >"$TMP/ab-build-$1.log" 2>&1
}
t0=$(date +%s)
build base ab/base & pb=$!
build head . & ph=$!
wait $pb; rb=$?
wait $ph; rh=$?
for name in base head; do
  grep -m1 "qformats: CUDA kernels" "$TMP/ab-build-$name.log" | sed "s/^[ -]*/$name: /"
done
if [ $rb != 0 ] || [ $rh != 0 ]; then
  cp "$TMP"/ab-build-{base,head}.log "$OUT"/
  echo "gpu_ab: build failed (base $rb, head $rh): $OUT/ab-build-*.log" >&2
  tail -n 20 "$TMP/ab-build-base.log" "$TMP/ab-build-head.log" >&2
  exit 1
fi
echo "gpu_ab: both built in $(($(date +%s) - t0)) s"
status=0
rm -f "$OUT/ab-base.txt" "$OUT/ab-head.txt"
for ((i = 1; i <= rounds; i++)); do
  for name in base head; do
    echo "=== round $i" >>"$OUT/ab-$name.txt"
    PYTHONPATH="$TMP/qf-$name${site:+:$site}" "$@" 2>&1 | tee -a "$OUT/ab-$name.txt" | sed "s/^/$name|/"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
done
exit $status
