#!/usr/bin/env bash
# Runs THERE (a GPU machine, with target/gpu-bundle from scripts/gpu-bundle.sh):
# the kernel tests (every CUDA kernel against its CPU reference), where GPT-2 124M's
# training step spends its time on the GPU, op by op (`run --trace`, summed by
# scripts/trace_summary.py), and a GPT-2-shaped `run --check` against the CPU
# reference. Output under $OUT (else target/gpu-profile/). The vocabulary is padded
# to 50304 as PyTorch's baseline (benches/python/torch_gpu.py) pads it; VOCAB=50257
# runs the unpadded one.
#
#   scripts/gpu-profile.sh [STEPS]
set -uo pipefail
cd "$(dirname "$0")/.."
B=target/gpu-bundle
OUTDIR=${OUT:-target/gpu-profile}
mkdir -p "$OUTDIR"
STEPS=${1:-4}
say() { echo "$*"; }
# shellcheck source=scripts/gpu-libs.sh
source scripts/gpu-libs.sh >/dev/null
REQUIRE_GPU=1 timeout 120 "$B/tests/meshplan-kernels" cuda:: --test-threads=1 2>&1 |
    tee "$OUTDIR/kernel-tests.txt" | grep -v ' ok$'
sed -e 's/dropout: true/dropout: false/' -e "s/vocab: 50257/vocab: ${VOCAB:-50304}/" \
    models/gpt2-124m.yaml >/tmp/gpt2-nodropout.yaml
sed 's/gpus_per_node: 8/gpus_per_node: 1/' topologies/h200-node.yaml >/tmp/h200-1gpu.yaml
"$B/bin/meshplan" plan /tmp/gpt2-nodropout.yaml /tmp/h200-1gpu.yaml --global-batch 32 \
    --config dp=1,tp=1,pp=1,cp=1,mbs=16,zero=0,recompute=none -o /tmp/gpt2.json --quiet >/dev/null
timeout 120 "$B/bin/meshplan" run /tmp/gpt2.json --backend cuda --steps "$STEPS" \
    --trace "$OUTDIR/gpt2-trace.json" 2>&1 | tee "$OUTDIR/gpt2-run.txt"
python3 scripts/trace_summary.py "$OUTDIR/gpt2-trace.json" | tee "$OUTDIR/gpt2-ops.txt"
gzip -f "$OUTDIR/gpt2-trace.json"
# The same run untraced (tracing costs a few ms a step), and with TORCH=1 PyTorch's
# eager and compiled baselines beside it in the same window.
timeout 120 "$B/bin/meshplan" run /tmp/gpt2.json --backend cuda --steps 6 --json 2>/dev/null \
    >"$OUTDIR/gpt2-run.json"
grep -m1 '"tokens_per_s"' "$OUTDIR/gpt2-run.json"
if [ "${TORCH:-0}" = 1 ]; then
    python3 benches/python/torch_gpu.py --meshplan-train "$OUTDIR/gpt2-run.json" \
        --json "$OUTDIR/torch_gpu.json" 2>&1 | grep -v Warning | tee "$OUTDIR/torch.txt"
fi
"$B/bin/meshplan" plan models/small-gpt2.yaml topologies/cpu-test-mesh.yaml \
    --config dp=4,tp=2,pp=1,cp=1,sp=true,mbs=2 -o /tmp/small-gpt2.json --quiet >/dev/null
timeout 120 "$B/bin/meshplan" run /tmp/small-gpt2.json --backend cuda --steps 3 --check 2>&1 |
    tee "$OUTDIR/small-gpt2-check.txt"
# Registers and spills of the attention kernels (ptxas on the cached PTX, whose last
# line is the cache's marker).
PTXAS=$(command -v ptxas || ls /usr/local/cuda*/bin/ptxas 2>/dev/null | head -n 1)
if [ -n "$PTXAS" ]; then
    for f in "${XDG_CACHE_HOME:-$HOME/.cache}"/meshplan/ptx/*; do
        grep -q 'flash_fwd_bf16_64' "$f" 2>/dev/null || continue
        head -n -1 "$f" >/tmp/attention.ptx
        arch=$(grep -m1 '^.target' /tmp/attention.ptx | awk '{print $2}')
        "$PTXAS" -arch="$arch" -v /tmp/attention.ptx -o /dev/null 2>&1 |
            grep -E 'Compiling entry|spill|Used' | tee "$OUTDIR/attention-registers.txt"
    done
fi
