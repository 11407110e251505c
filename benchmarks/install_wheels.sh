# Sourced by the GPU drivers (gpu_suite, tune_and_bench, gate_check, before_after):
#   install_wheels LOG      the wheels carried in .whl/ (what the GPU image lacks) into /tmp/site, on PYTHONPATH
#   install_tree LOG DIR    tritune from DIR, editable
# Each appends its pip output to LOG and, when pip fails, prints LOG and returns 1.
install_wheels() {
  compgen -G ".whl/*.whl" >/dev/null || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >>"$1" 2>&1 || { cat "$1"; return 1; }
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
}

install_tree() {
  (cd "$2" && python -m pip install -q --no-deps --no-build-isolation -e . >>"$1" 2>&1) || { cat "$1"; return 1; }
}
