# Sourced by the drivers: $W (= $OUT/w) made, the carried wheels installed into /tmp/site, tritune installed
# editable (its log in $W/install.log), triton's cache and the commit (from .commit) exported.
: "${OUT:?}"
W=$OUT/w; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
python -m pip install -q --no-deps --no-build-isolation -e . >$W/install.log 2>&1 || { cat $W/install.log; exit 1; }
export TRITON_CACHE_DIR=/tmp/tcache TRITUNE_COMMIT=$(cat .commit 2>/dev/null)
