#!/usr/bin/env bash
# The project's tests, on a fresh machine with only Rust (cargo), gcc and Python 3:
#
#  1. the CPU suite: `cargo test --workspace --release` (also runnable alone), then
#     the quick executor goldens again under the AVX2/FMA GEMM kernels (the base set,
#     where the suite took this CPU's AVX-512 ones);
#  2. the GPU layer without a GPU: NVRTC, from PyPI's wheel installed once into a
#     venv under target/, compiles every CUDA kernel for sm_80 and sm_90 with no
#     warning and the PTX cache round-trips (REQUIRE_NVRTC=1: a skip is a failure);
#     ptxas, from the nvcc wheel beside it, assembles every module (inline asm
#     included) and finds no spill in the tensor-core attention (REQUIRE_PTXAS=1);
#     the GPU kernel tests skip and say why (run with REQUIRE_GPU=1 on a GPU machine);
#  3. `run --backend cuda` of a `--features cuda` binary exits 1 naming what is
#     missing, without a panic;
#  4. clippy on every target with `--features cuda`, warnings denied;
#  5. the Python suites, each in a pinned virtual environment cached outside the
#     clone (scripts/pyvenv.sh; the first run downloads PyPI's torch, twice): Hugging
#     Face fidelity against transformers (tests/python/hf), the exports read by the
#     frameworks' own configuration code (tests/python/exports), the Python package
#     built from ./python (tests/python/package) and the report page in headless
#     Chromium (tests/python/report; installs Debian's chromium when root).
set -euo pipefail
cd "$(dirname "$0")/.."

# NVRTC 13.0, matching the `cuda` feature (cudarc's cuda-13000): it ships
# nvidia/cu13/lib/libnvrtc.so.13, which cudarc finds through LD_LIBRARY_PATH.
NVRTC_WHEEL="nvidia-cuda-nvrtc==13.0.88"
# ptxas of the same release (nvidia/cu13/bin/ptxas): assembles the PTX, inline asm
# included, which NVRTC passes through unchecked.
NVCC_WHEEL="nvidia-cuda-nvcc==13.0.88"
NVRTC_DIR=target/nvrtc-venv

# Each step's heading, with the seconds the previous one took.
last=$SECONDS
step() {
    printf '\n== %s (previous step %ss, total %ss)\n' "$*" $((SECONDS - last)) "$SECONDS"
    last=$SECONDS
}

step "CPU suite"
cargo test --workspace --release

# The suite above checks the executor goldens of the GEMM kernels this CPU takes
# (AVX-512 where it has them: tests/data/golden/exec/avx512f/); these check the base
# set, recorded with the AVX2/FMA kernels, on the quick half of the golden tests.
step "executor goldens under the AVX2/FMA GEMM kernels (--no-default-features)"
cargo test --release -p meshplan-tests --no-default-features --test it -- device:: executor:: infer:: infer_moe::

step "Hugging Face fidelity: meshplan run against transformers' generate (tests/python/hf)"
cargo build --release
tests/python/hf/run.sh

step "exports read by Megatron-LM, torchtitan, DeepSpeed, SGLang and vLLM (tests/python/exports)"
tests/python/exports/run.sh

step "the Python package: pip install ./python, then pytest (tests/python/package)"
tests/python/package/run.sh

step "the report page in headless Chromium (tests/python/report)"
tests/python/report/run.sh

step "NVRTC wheel ($NVRTC_WHEEL) in $NVRTC_DIR"
stamp="$NVRTC_DIR/.installed-${NVRTC_WHEEL//[^A-Za-z0-9.]/_}-${NVCC_WHEEL//[^A-Za-z0-9.]/_}"
if [ ! -f "$stamp" ]; then
    rm -rf "$NVRTC_DIR"
    if python3 -m venv "$NVRTC_DIR" 2>/dev/null; then
        "$NVRTC_DIR/bin/python" -m pip install --quiet --disable-pip-version-check "$NVRTC_WHEEL" "$NVCC_WHEEL"
    else
        # No venv module (Debian without python3-venv): a plain target folder.
        python3 -m pip install --quiet --disable-pip-version-check --target "$NVRTC_DIR" "$NVRTC_WHEEL" "$NVCC_WHEEL"
    fi
    touch "$stamp"
fi
nvrtc_so=$(find "$NVRTC_DIR" -name 'libnvrtc.so.13' -print -quit)
if [ -z "$nvrtc_so" ]; then
    echo "scripts/test.sh: $NVRTC_WHEEL installed no libnvrtc.so.13 under $NVRTC_DIR" >&2
    exit 1
fi
NVRTC_LIB=$(cd "$(dirname "$nvrtc_so")" && pwd)
export LD_LIBRARY_PATH="$NVRTC_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "libnvrtc: $NVRTC_LIB"
ptxas=$(find "$NVRTC_DIR" -name ptxas -type f -print -quit)
if [ -z "$ptxas" ]; then
    echo "scripts/test.sh: $NVCC_WHEEL installed no ptxas under $NVRTC_DIR" >&2
    exit 1
fi
# Absolute: cargo runs each test binary from its crate's folder.
PTXAS="$(cd "$(dirname "$ptxas")" && pwd)/ptxas"
chmod +x "$PTXAS"
export PTXAS
echo "ptxas: $PTXAS"

step "CUDA kernels: NVRTC compile tests (GPU tests skip without a GPU)"
REQUIRE_NVRTC=1 REQUIRE_PTXAS=1 cargo test -p meshplan-kernels --release --features cuda

step "run --backend cuda with a --features cuda binary"
# `--workspace` (the CPU suite's selection) reuses its test binary; only the binary
# under test is rebuilt, with the feature.
MESHPLAN_BIN_FEATURES=cuda cargo test --workspace --release --test it -- cuda::

step "clippy --features cuda"
cargo clippy --workspace --all-targets --release --features cuda -- -D warnings

step "done"
