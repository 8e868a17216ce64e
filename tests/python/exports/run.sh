#!/usr/bin/env bash
# Feeds meshplan's exports to the frameworks' own configuration code, without a GPU:
# Megatron-LM's parse_args/validate_args (megatron-core 0.19.2), torchtitan 0.3.0's
# ConfigManager and ParallelDims (and 0.2.2's, which reads the TOML), DeepSpeed
# 0.19.8's DeepSpeedConfig, SGLang 0.5.23's ServerArgs resolution and vLLM 0.34.0's
# EngineArgs/create_engine_config. A missing framework fails; nothing is skipped.
#
#   tests/python/exports/run.sh [PYTEST ARGS]
#
# MESHPLAN_BIN names the binary (default target/release/meshplan, built if absent).
# The venv is cached by scripts/pyvenv.sh; the first run installs about 6 GB
# (PyPI's torch with its CUDA libraries) in a few minutes.
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=tests/python/exports
export DS_BUILD_OPS=0 # DeepSpeed from its sdist, no compiled ops
py=$(scripts/pyvenv.sh "$here/requirements.txt")
venv=$(dirname "$(dirname "$py")")

# What pyvenv.sh cannot express: packages without their dependencies, torchtitan
# 0.2.2 beside 0.3.0, and megatron-core 0.19.2's Python sources on Python 3.11.
TORCHTITAN_TOML=torchtitan==0.2.2
MEGATRON_CORE=megatron-core==0.19.2
stamp=$venv/.exports-$( (cat "$here/requirements-nodeps.txt"; echo "$TORCHTITAN_TOML $MEGATRON_CORE") | sha256sum | cut -c1-12)
tt=$venv/torchtitan-toml
mc=$venv/megatron-core
if [ ! -f "$stamp" ]; then
    pip=("$py" -m pip --disable-pip-version-check --quiet)
    "${pip[@]}" install --no-deps -r "$here/requirements-nodeps.txt" >&2
    rm -rf "$tt" "$mc"
    "${pip[@]}" install --no-deps --target "$tt" "$TORCHTITAN_TOML" >&2
    dl=$(mktemp -d)
    "${pip[@]}" download --no-deps --only-binary :all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 -d "$dl" "$MEGATRON_CORE" >&2
    "$py" -m zipfile -e "$dl"/megatron_core-*.whl "$mc"
    rm -rf "$dl"
    touch "$stamp"
fi

bin=${MESHPLAN_BIN:-target/release/meshplan}
[ -x "$bin" ] || cargo build --release
MESHPLAN_BIN=$(realpath "$bin") TORCHTITAN_022_DIR=$tt MEGATRON_CORE_DIR=$mc \
    exec "$py" -m pytest -q -p no:cacheprovider -W ignore "$here" "$@"
