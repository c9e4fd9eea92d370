# Sourced by tools/gpu_check.sh and tools/gpu_ab.sh: the wheels carried to the GPU machine in .whl/
# (bitsandbytes for the nf4 comparisons; see the device README) installed into /tmp/site, which
# then leads PYTHONPATH. Nothing happens without .whl/*.whl.
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
