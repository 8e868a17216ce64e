#!/usr/bin/env bash
# Prints the path of a Python virtual environment holding exactly the pinned
# packages of REQUIREMENTS, creating it on first use:
#
#   py=$(scripts/pyvenv.sh tests/python/hf/requirements.txt) && "$py" -m pytest ...
#
# The environment lives outside the clone (MESHPLAN_VENV_CACHE, default
# ~/.cache/meshplan/venvs) under a name that carries a hash of the requirements
# file, so a fresh clone on the same machine reuses it and a changed pin makes a
# new one. A stamp written after a successful install marks it complete; a half
# install is removed and redone. pip's output goes to stderr.
set -euo pipefail
req=${1:?usage: scripts/pyvenv.sh REQUIREMENTS_FILE}
[ -f "$req" ] || { echo "scripts/pyvenv.sh: no requirements file $req" >&2; exit 2; }
cache=${MESHPLAN_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/meshplan/venvs}
name=$(basename "$(dirname "$req")")-$(sha256sum "$req" | cut -c1-12)
dir=$cache/$name
if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir"
    mkdir -p "$cache"
    python3 -m venv "$dir" >&2
    "$dir/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
    "$dir/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2
    touch "$dir/.complete"
fi
echo "$dir/bin/python"
