# Sourced by ci/setup.sh and ci/test.sh: make the checkout's virtual environment .venv and set PY
# to its python. A distribution's python3 refuses pip installs (PEP 668, "externally-managed-
# environment") and a minimal Debian/Ubuntu lacks venv's ensurepip (package python3-venv), so
# everything goes into .venv, never into python3 itself.
kvstack_venv() {
  local base=${PYTHON:-python3} venv=${KVSTACK_VENV:-.venv}
  if ! command -v "$base" >/dev/null 2>&1; then
    echo "error: no $base on PATH; run: sudo apt-get install python3 python3-venv (or set PYTHON)" >&2; return 1
  fi
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    rm -rf "$venv"
    if ! "$base" -m venv "$venv" >/dev/null 2>&1; then
      rm -rf "$venv"
      # Debian's python3 ships venv without ensurepip; python3-venv brings it.
      local pkg; pkg=python3-venv
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
          DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null || {
          echo "error: apt-get install $pkg failed; install it, then run this again" >&2; return 1; }
        "$base" -m venv "$venv" || { echo "error: $base -m venv $venv failed after installing $pkg" >&2; return 1; }
      else
        echo "error: $base cannot make a virtual environment (no ensurepip); run: sudo apt-get install $pkg" >&2
        return 1
      fi
    fi
  fi
  case $venv in /*) ;; *) venv=$PWD/$venv ;; esac
  PY=$venv/bin/python
  export VIRTUAL_ENV=$venv PATH=$venv/bin:$PATH
}
