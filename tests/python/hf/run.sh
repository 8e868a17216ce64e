#!/usr/bin/env bash
# The Hugging Face fidelity suite: tiny random checkpoints made with transformers
# (Llama, Mistral, Qwen2, GPT-2 and their config variants, EOS, families meshplan
# must refuse), greedy tokens and per-step fp32 logits of `meshplan run --weights`
# on several plans compared with transformers' `generate` (max abs diff <= 1e-4).
#
#   tests/python/hf/run.sh                      # the whole suite
#   tests/python/hf/run.sh -k gpt2 -x           # pytest arguments pass through
#   MESHPLAN_BIN=/path/to/meshplan tests/python/hf/run.sh
#
# Needs a built binary: MESHPLAN_BIN, default target/release/meshplan (cargo build
# --release). The pinned environment (requirements.txt: torch, transformers, ...)
# is made once by scripts/pyvenv.sh and cached outside the clone; the first run
# installs it in about 3 minutes (5.6 GB: torch from PyPI is the CUDA build, with
# its nvidia-* and triton wheels; the suite runs on the CPU). A warm run takes
# under a minute on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
py=$(scripts/pyvenv.sh tests/python/hf/requirements.txt)
export PYTHONDONTWRITEBYTECODE=1
exec "$py" -m pytest -q -p no:cacheprovider tests/python/hf "$@"
