# Sourced by ci/install.sh and ci/test.sh: the project's virtual environment, made from the
# distribution's own python3 (or $PYTHON). Stock Debian 12 and Ubuntu 24.04 refuse `pip install`
# into their python3 (PEP 668) and minimal images lack the venv module: as root (or with
# password-less sudo) python3-venv is installed with apt, otherwise the exact command is printed.
# Sets VENV_PY.

kvstack_venv() {
  local base=${PYTHON:-python3} venv=${KVSTACK_VENV:-.venv} sudo=""
  if ! command -v "$base" >/dev/null 2>&1; then
    echo "error: no $base on PATH; install it (sudo apt-get install python3) or set PYTHON" >&2
    return 1
  fi
  if ! "$base" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "error: $base is $("$base" -V 2>&1); kvstack needs Python 3.10 or newer (set PYTHON)" >&2
    return 1
  fi
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    VENV_PY=$venv/bin/python
    return 0
  fi
  if ! "$base" -m venv "$venv" >/dev/null 2>&1; then
    rm -rf "$venv"  # a half-made one (venv without ensurepip) would be taken next time
    if [ "$(id -u)" != 0 ]; then
      if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo="sudo"
      else
        echo "error: $base cannot make a virtual environment (the venv module or ensurepip is" \
             "missing); run: sudo apt-get install python3-venv   then run this again" >&2
        return 1
      fi
    fi
    echo "installing python3-venv with apt (needed to make $venv)" >&2
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
      $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        python3-venv >/dev/null || { echo "error: apt-get install python3-venv failed" >&2; return 1; }
    "$base" -m venv "$venv" || { rm -rf "$venv"; echo "error: $base -m venv $venv failed" >&2; return 1; }
  fi
  VENV_PY=$venv/bin/python
}
