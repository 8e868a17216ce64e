#!/usr/bin/env bash
# Runs THERE: on a GPU machine (CUDA 13 driver, NCCL and PyTorch, e.g. inside Python
# packages; no Rust), from the repository root, with target/gpu-bundle made by
# scripts/gpu-bundle.sh. One go, at most 9 minutes; everything is also written under
# $OUT when it is set (else target/gpu-check/).
#
#   scripts/gpu-check.sh
#
# $OUT comes back as at most 8 files, so the log is written there as it grows and
# everything else is packed into one gpu-check.tgz at the end.
#
# Steps, each PASS / FAIL / SKIP: nvidia-smi; the kernel tests with REQUIRE_GPU=1
# (every CUDA kernel against its CPU reference); the CUDA device's tests (its
# methods against the host device's); `run --backend cuda --check` (tiny-gpt over 8
# data-parallel ranks sharing the GPU, against the fp32 CPU reference within bf16
# tolerances; ZeRO-1; tp=2 with and without sp; a padded vocabulary at tp=2; tp=2 pp=2; ZeRO-3; cp=2; dropout;
# routed experts over ep=2, dropless and under a capacity; a dense layer before an
# MoE one with top-1 experts over tp, all on the device interpreter); GPT-2 124M
# training on
# the GPU (tokens/s, MFU); the NCCL communicator tests (world size 1, and 2 when two
# GPUs are visible) with REQUIRE_GPU=1; `meshplan
# calibrate` (overlay.yaml); benches/python/torch_gpu.py (PyTorch bf16 matmul on the
# calibrate shapes beside meshplan's cuBLASLt numbers, and GPT-2 124M training
# tokens/s and MFU, eager and torch.compile). Exits non-zero if any step fails.
set -uo pipefail
cd "$(dirname "$0")/.."
B=target/gpu-bundle
OUTDIR=target/gpu-check
rm -rf "$OUTDIR"
mkdir -p "$OUTDIR"
LOG="${OUT:-$OUTDIR}/gpu-check.log"
: >"$LOG"
START=$SECONDS
BUDGET=${GPU_CHECK_BUDGET_S:-540}
# Each small `run --check` gets at most this long: a hang must not eat the budget.
STEP=${GPU_CHECK_STEP_S:-120}
failed=0
summary=()

say() { echo "$*" | tee -a "$LOG"; }
# result NAME STATUS
result() {
    summary+=("$2 $1")
    say "== $2: $1 ($((SECONDS - START))s elapsed)"
    [ "$2" = FAIL ] && failed=1
    return 0
}
# run NAME SECONDS CMD...: runs with a timeout (what is left of the budget, at most
# SECONDS), output to the log and $OUTDIR/NAME.txt; sets $rc.
run() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - (SECONDS - START)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -le 5 ]; then
        rc=124
        say "-- $name: no time left in the ${BUDGET}s budget"
        return
    fi
    say "-- $name: $* (timeout ${limit}s)"
    timeout "$limit" "$@" >"$OUTDIR/$name.txt" 2>&1
    rc=$?
    cat "$OUTDIR/$name.txt" >>"$LOG"
    tail -n 40 "$OUTDIR/$name.txt"
}

if [ ! -x "$B/bin/meshplan" ]; then
    say "gpu-check: no $B/bin/meshplan: run scripts/gpu-bundle.sh where Rust is, and bring target/gpu-bundle"
    exit 1
fi

# shellcheck source=scripts/gpu-libs.sh
source scripts/gpu-libs.sh
export REQUIRE_GPU=1 REQUIRE_NVRTC=1

# --- 1. nvidia-smi
run nvidia-smi 30 nvidia-smi
if [ "$rc" = 0 ]; then result nvidia-smi PASS; else result nvidia-smi FAIL; fi
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)

# --- 2. kernel tests (GPU against CPU reference)
run kernel-tests 150 "$B/tests/meshplan-kernels" cuda:: --test-threads=1
if [ "$rc" = 0 ]; then result kernel-tests PASS; else result kernel-tests FAIL; fi

# --- 2b. the CUDA device against the host device (executor/src/device/cuda.rs)
run device-tests 120 "$B/tests/meshplan-executor" device:: --test-threads=1 --nocapture
if [ "$rc" = 0 ]; then result device-tests PASS; else result device-tests FAIL; fi

# --- 2c. run --check on the GPU: the device interpreter against the fp32 CPU run
run plan-tiny 30 "$B/bin/meshplan" plan models/tiny-gpt.yaml topologies/cpu-test-mesh.yaml \
    --config dp=8,tp=1,pp=1,cp=1,zero=0 -o "$OUTDIR/tiny-dp8.json" --quiet
run run-check "$STEP" "$B/bin/meshplan" run "$OUTDIR/tiny-dp8.json" --backend cuda --steps 5 --check \
    --trace "$OUTDIR/tiny-dp8-trace.json"
if [ "$rc" = 0 ]; then result "run --backend cuda --check" PASS; else result "run --backend cuda --check" FAIL; fi
run plan-tiny-zero1 30 "$B/bin/meshplan" plan models/tiny-gpt.yaml topologies/cpu-test-mesh.yaml \
    --config dp=8,tp=1,pp=1,cp=1,zero=1 -o "$OUTDIR/tiny-dp8-zero1.json" --quiet
run run-check-zero1 "$STEP" "$B/bin/meshplan" run "$OUTDIR/tiny-dp8-zero1.json" --backend cuda --steps 5 --check
if [ "$rc" = 0 ]; then result "run --backend cuda --check (ZeRO-1)" PASS; else result "run --backend cuda --check (ZeRO-1)" FAIL; fi

# Tensor parallelism on the device interpreter: split weights, activation sums on
# device buffers, the vocabulary-parallel loss's three kernels.
run plan-tiny-tp2 30 "$B/bin/meshplan" plan models/tiny-gpt.yaml topologies/cpu-test-mesh.yaml \
    --config dp=4,tp=2,pp=1,cp=1,sp=false,zero=1 -o "$OUTDIR/tiny-dp4tp2.json" --quiet
run run-check-tp2 "$STEP" "$B/bin/meshplan" run "$OUTDIR/tiny-dp4tp2.json" --backend cuda --steps 5 --check
if [ "$rc" = 0 ]; then result "run --backend cuda --check (device, dp=4 tp=2 ZeRO-1)" PASS; else result "run --backend cuda --check (device, dp=4 tp=2 ZeRO-1)" FAIL; fi
run plan-tiny-sp 30 "$B/bin/meshplan" plan models/tiny-gpt.yaml topologies/cpu-test-mesh.yaml \
    --config dp=4,tp=2,pp=1,cp=1,sp=true -o "$OUTDIR/tiny-dp4tp2sp.json" --quiet
run run-check-sp "$STEP" "$B/bin/meshplan" run "$OUTDIR/tiny-dp4tp2sp.json" --backend cuda --steps 5 --check
if [ "$rc" = 0 ]; then result "run --backend cuda --check (device, dp=4 tp=2 sp)" PASS; else result "run --backend cuda --check (device, dp=4 tp=2 sp)" FAIL; fi
# A padded vocabulary (251 tokens in 252 rows): the loss's -inf bias on the
# padded column of the second tensor rank, in bf16 on the device.
sed 's/vocab: 256/vocab: 251/' models/tiny-gpt.yaml > "$OUTDIR/tiny-vocab251.yaml"
run plan-tiny-padded 30 "$B/bin/meshplan" plan "$OUTDIR/tiny-vocab251.yaml" topologies/cpu-test-mesh.yaml \
    --config dp=4,tp=2,pp=1,cp=1,sp=false --make-vocab-size-divisible-by 4 -o "$OUTDIR/tiny-padded.json" --quiet
run run-check-padded "$STEP" "$B/bin/meshplan" run "$OUTDIR/tiny-padded.json" --backend cuda --steps 5 --check
if [ "$rc" = 0 ]; then result "run --backend cuda --check (device, padded vocabulary, dp=4 tp=2)" PASS; else result "run --backend cuda --check (device, padded vocabulary, dp=4 tp=2)" FAIL; fi

# Pipeline parallelism with tensor parallelism on the device interpreter.
run plan-tiny-tp 30 "$B/bin/meshplan" plan models/tiny-gpt.yaml topologies/cpu-test-mesh.yaml \
    --config dp=2,tp=2,pp=2,mbs=1 -o "$OUTDIR/tiny-tp2pp2.json" --quiet
run run-check-pp "$STEP" "$B/bin/meshplan" run "$OUTDIR/tiny-tp2pp2.json" --backend cuda --steps 5 --check
if [ "$rc" = 0 ]; then result "run --backend cuda --check (device, dp=2 tp=2 pp=2)" PASS; else result "run --backend cuda --check (device, dp=2 tp=2 pp=2)" FAIL; fi
# ZeRO-3 (per-segment gathers and reduce-scatters) on the device interpreter.
run plan-zero3 30 "$B/bin/meshplan" plan models/tiny-gpt.yaml topologies/cpu-test-mesh.yaml \
    --config dp=4,tp=2,pp=1,cp=1,zero=3 -o "$OUTDIR/zero3.json" --quiet
run run-check-zero3 "$STEP" "$B/bin/meshplan" run "$OUTDIR/zero3.json" --backend cuda --steps 5 --check
if [ "$rc" = 0 ]; then result "run --backend cuda --check (device, dp=4 tp=2 ZeRO-3)" PASS; else result "run --backend cuda --check (device, dp=4 tp=2 ZeRO-3)" FAIL; fi
# ZeRO-2 (each micro-batch's gradients reduce-scattered and let go, the parts added
# up) with sequence parallelism, on the device interpreter: 8 sequences over dp=2 at
# mbs=1 are 4 micro-batches.
run plan-zero2 30 "$B/bin/meshplan" plan models/tiny-gpt.yaml topologies/cpu-test-mesh.yaml \
    --config dp=2,tp=2,pp=2,cp=1,mbs=1,sp=true,zero=2 -o "$OUTDIR/zero2.json" --quiet
run run-check-zero2 "$STEP" "$B/bin/meshplan" run "$OUTDIR/zero2.json" --backend cuda --steps 5 --check
if [ "$rc" = 0 ]; then result "run --backend cuda --check (device, dp=2 tp=2 pp=2 ZeRO-2, 4 micro-batches)" PASS; else result "run --backend cuda --check (device, dp=2 tp=2 pp=2 ZeRO-2, 4 micro-batches)" FAIL; fi
# Context parallelism (ring attention) on the device interpreter.
run plan-cp2 30 "$B/bin/meshplan" plan models/tiny-gpt.yaml topologies/cpu-test-mesh.yaml \
    --config dp=2,tp=2,pp=1,cp=2,sp=true -o "$OUTDIR/cp2.json" --quiet
run run-check-cp2 "$STEP" "$B/bin/meshplan" run "$OUTDIR/cp2.json" --backend cuda --steps 5 --check
if [ "$rc" = 0 ]; then result "run --backend cuda --check (device, dp=2 tp=2 cp=2 sp)" PASS; else result "run --backend cuda --check (device, dp=2 tp=2 cp=2 sp)" FAIL; fi
# Residual and attention dropout: the GPU draws the CPU reference's masks.
sed 's/position: rope/position: rope\n  dropout: true/' models/tiny-gpt.yaml >"$OUTDIR/tiny-gpt-dropout.yaml"
run plan-dropout 30 "$B/bin/meshplan" plan "$OUTDIR/tiny-gpt-dropout.yaml" topologies/cpu-test-mesh.yaml \
    --config dp=4,tp=2,sp=true,pp=1,cp=1,mbs=2,zero=1 -o "$OUTDIR/dropout.json" --quiet
run run-check-dropout "$STEP" "$B/bin/meshplan" run "$OUTDIR/dropout.json" --backend cuda --steps 5 --check
if [ "$rc" = 0 ]; then result "run --backend cuda --check (device, dropout, dp=4 tp=2 sp)" PASS; else result "run --backend cuda --check (device, dropout, dp=4 tp=2 sp)" FAIL; fi
# Routed experts split over ep: tokens exchanged by All-to-All on device buffers.
run plan-ep2 30 "$B/bin/meshplan" plan models/tiny-moe.yaml topologies/cpu-test-mesh.yaml \
    --config dp=4,ep=2,tp=2,pp=1,cp=1,sp=true -o "$OUTDIR/ep2.json" --quiet
run run-check-ep2 "$STEP" "$B/bin/meshplan" run "$OUTDIR/ep2.json" --backend cuda --steps 5 --check
if [ "$rc" = 0 ]; then result "run --backend cuda --check (device, tiny-moe dp=4 ep=2 tp=2 sp)" PASS; else result "run --backend cuda --check (device, tiny-moe dp=4 ep=2 tp=2 sp)" FAIL; fi
# The same under an expert capacity: which slots each expert keeps, and the padding,
# chosen on the device (moe_capacity); about 14% of the assignments are dropped.
run plan-ep2-capacity 30 "$B/bin/meshplan" plan models/tiny-moe-capacity.yaml topologies/cpu-test-mesh.yaml \
    --config dp=4,ep=2,tp=2,pp=1,cp=1,sp=true -o "$OUTDIR/ep2-capacity.json" --quiet
run run-check-ep2-capacity "$STEP" "$B/bin/meshplan" run "$OUTDIR/ep2-capacity.json" --backend cuda --steps 5 --check
if [ "$rc" = 0 ]; then result "run --backend cuda --check (device, tiny-moe-capacity dp=4 ep=2 tp=2 sp)" PASS; else result "run --backend cuda --check (device, tiny-moe-capacity dp=4 ep=2 tp=2 sp)" FAIL; fi
# A dense layer before an MoE one, its SwiGLU experts split over tp (ep=1) and a
# top-1 router (its one weight exactly 1 in the moe_route kernel): each layer runs
# its own block's ops, each tensor rank holds its columns of every expert.
sed -e 's/top_k: 2/top_k: 1/' models/tiny-moe-dense-first.yaml >"$OUTDIR/dense-first-top1.yaml"
run plan-dense-first 30 "$B/bin/meshplan" plan "$OUTDIR/dense-first-top1.yaml" topologies/cpu-test-mesh.yaml \
    --config dp=4,ep=1,tp=2,pp=1,cp=1,sp=true -o "$OUTDIR/dense-first.json" --quiet
run run-check-dense-first "$STEP" "$B/bin/meshplan" run "$OUTDIR/dense-first.json" --backend cuda --steps 5 --check
if [ "$rc" = 0 ]; then result "run --backend cuda --check (device, dense then MoE layers, top-1, experts over tp=2)" PASS; else result "run --backend cuda --check (device, dense then MoE layers, top-1, experts over tp=2)" FAIL; fi
# Inference on the GPU: weights, activations and KV cache on the device, tp=2 and
# pp=2 as threads sharing it; the prompt's logits against the fp32 CPU run.
run plan-infer 30 "$B/bin/meshplan" plan models/tiny-llama-inference.yaml topologies/cpu-test-mesh.yaml \
    --config dp=2,tp=2,pp=2,cp=1 -o "$OUTDIR/infer.json" --quiet
run run-check-infer "$STEP" "$B/bin/meshplan" run "$OUTDIR/infer.json" --backend cuda --check \
    --prompt-ids 1,2,3,4,5,6 --max-new-tokens 8
if [ "$rc" = 0 ]; then result "run --backend cuda --check (inference, dp=2 tp=2 pp=2)" PASS; else result "run --backend cuda --check (inference, dp=2 tp=2 pp=2)" FAIL; fi
# Sampling on the GPU: each token drawn on the device (sample_parts_f32; the kernel
# test above holds it to the CPU's draws on the same logits). bf16 logits may draw
# other tokens than the fp32 CPU run, so this runs without --check.
run run-sampled-infer "$STEP" "$B/bin/meshplan" run "$OUTDIR/infer.json" --backend cuda \
    --prompt-ids 1,2,3,4,5,6 --max-new-tokens 8 --temperature 0.8 --top-p 0.9 --seed 3
if [ "$rc" = 0 ]; then result "run --backend cuda (inference, sampled, dp=2 tp=2 pp=2)" PASS; else result "run --backend cuda (inference, sampled, dp=2 tp=2 pp=2)" FAIL; fi
# Disaggregated serving on the GPU: a prefill pool (tp=2) hands each request's KV
# cache, as device buffers, to a decode pool (tp=1); routed experts at inference.
sed 's/gpus_per_node: 8/gpus_per_node: 4/' topologies/cpu-test-mesh.yaml >"$OUTDIR/mesh-4.yaml"
printf 'kind: inference\nprompt_len: 8\noutput_len: 8\nconcurrency: 2\nserving: {mode: disaggregated, concurrency: {min: 2, max: 2}}\n' \
    >"$OUTDIR/disagg-workload.yaml"
run deploy-disagg 30 "$B/bin/meshplan" deploy models/tiny-llama-inference.yaml "$OUTDIR/mesh-4.yaml" \
    --workload "$OUTDIR/disagg-workload.yaml" --prefill-config tp=2 --decode-config tp=1 \
    -o "$OUTDIR/disagg.json"
run run-check-disagg "$STEP" "$B/bin/meshplan" run "$OUTDIR/disagg.json" --backend cuda --check
if [ "$rc" = 0 ]; then result "run --backend cuda --check (disaggregated, prefill tp=2, decode tp=1)" PASS; else result "run --backend cuda --check (disaggregated, prefill tp=2, decode tp=1)" FAIL; fi
sed 's/gpus_per_node: 8/gpus_per_node: 2/' topologies/cpu-test-mesh.yaml >"$OUTDIR/mesh-2.yaml"
printf 'kind: inference\nprompt_len: 8\noutput_len: 8\nconcurrency: 2\n' >"$OUTDIR/infer-workload.yaml"
run plan-infer-moe 30 "$B/bin/meshplan" plan models/tiny-moe.yaml "$OUTDIR/mesh-2.yaml" \
    --workload "$OUTDIR/infer-workload.yaml" --config dp=2,ep=2,tp=1,pp=1,dp_attention=false \
    -o "$OUTDIR/infer-moe.json" --quiet
run run-check-infer-moe "$STEP" "$B/bin/meshplan" run "$OUTDIR/infer-moe.json" --backend cuda --check
if [ "$rc" = 0 ]; then result "run --backend cuda --check (inference, tiny-moe dp=2 ep=2)" PASS; else result "run --backend cuda --check (inference, tiny-moe dp=2 ep=2)" FAIL; fi
# Experts over both tp and ep at inference: each tensor rank routes its slice of
# the tokens and the slices' outputs are gathered over tp (one decode row per
# replica: one slice empty, padded).
run plan-infer-moe-tpep 30 "$B/bin/meshplan" plan models/tiny-moe.yaml "$OUTDIR/mesh-4.yaml" \
    --workload "$OUTDIR/infer-workload.yaml" --config dp=2,ep=4,tp=2,pp=1,dp_attention=false \
    -o "$OUTDIR/infer-moe-tpep.json" --quiet
run run-check-infer-moe-tpep "$STEP" "$B/bin/meshplan" run "$OUTDIR/infer-moe-tpep.json" --backend cuda --check
if [ "$rc" = 0 ]; then result "run --backend cuda --check (inference, tiny-moe dp=2 tp=2 ep=4)" PASS; else result "run --backend cuda --check (inference, tiny-moe dp=2 tp=2 ep=4)" FAIL; fi

# --- 2d. GPT-2 124M on one GPU (no dropout, as the PyTorch baseline): 32 sequences
# of 1024 tokens per step, micro-batch 16, the same batch as torch_gpu.py's default;
# the vocabulary padded to 50304 as the baseline pads it (a multiple of 8 keeps the
# LM head's GEMM on cuBLASLt's aligned kernels). The unpadded 50257 runs after, for
# the record.
sed -e 's/dropout: true/dropout: false/' -e 's/vocab: 50257/vocab: 50304/' \
    models/gpt2-124m.yaml >"$OUTDIR/gpt2-124m-nodropout.yaml"
sed 's/dropout: true/dropout: false/' models/gpt2-124m.yaml >"$OUTDIR/gpt2-124m-50257.yaml"
sed 's/gpus_per_node: 8/gpus_per_node: 1/' topologies/h200-node.yaml >"$OUTDIR/h200-1gpu.yaml"
run plan-gpt2 30 "$B/bin/meshplan" plan "$OUTDIR/gpt2-124m-nodropout.yaml" "$OUTDIR/h200-1gpu.yaml" \
    --global-batch 32 --config dp=1,tp=1,pp=1,cp=1,mbs=16,zero=0,recompute=none \
    -o "$OUTDIR/gpt2.json" --quiet
run gpt2-cuda 150 "$B/bin/meshplan" run "$OUTDIR/gpt2.json" --backend cuda --steps 6 --json
if [ "$rc" = 0 ]; then
    # The report is the JSON from its first line on (log lines come before it).
    sed -n '/^{/,$p' "$OUTDIR/gpt2-cuda.txt" >"$OUTDIR/gpt2-cuda.json"
    result gpt2-cuda PASS
else
    result gpt2-cuda FAIL
fi
run plan-gpt2-50257 30 "$B/bin/meshplan" plan "$OUTDIR/gpt2-124m-50257.yaml" "$OUTDIR/h200-1gpu.yaml" \
    --global-batch 32 --config dp=1,tp=1,pp=1,cp=1,mbs=16,zero=0,recompute=none \
    -o "$OUTDIR/gpt2-50257.json" --quiet
run gpt2-cuda-50257 90 "$B/bin/meshplan" run "$OUTDIR/gpt2-50257.json" --backend cuda --steps 4
if [ "$rc" = 0 ]; then result "gpt2-cuda (vocab 50257)" PASS; else result "gpt2-cuda (vocab 50257)" FAIL; fi
# A GPT-2-shaped model (LayerNorm with biases, GELU, learned positions, tied head,
# head dim 64: the tensor-core attention) against the CPU reference.
run plan-small-gpt2 30 "$B/bin/meshplan" plan models/small-gpt2.yaml topologies/cpu-test-mesh.yaml \
    --config dp=4,tp=2,pp=1,cp=1,sp=true,mbs=2 -o "$OUTDIR/small-gpt2.json" --quiet
run run-check-small-gpt2 "$STEP" "$B/bin/meshplan" run "$OUTDIR/small-gpt2.json" --backend cuda --steps 3 --check
if [ "$rc" = 0 ]; then result "run --backend cuda --check (device, small-gpt2 dp=4 tp=2 sp)" PASS; else result "run --backend cuda --check (device, small-gpt2 dp=4 tp=2 sp)" FAIL; fi

# --- 3. NCCL communicator (world 1; world 2 needs two GPUs and skips otherwise)
run nccl-tests 90 env REQUIRE_NCCL_LIB=1 "$B/tests/meshplan-executor" comm::nccl --test-threads=1 --nocapture
if [ "$rc" = 0 ]; then result "nccl-tests (GPUs: $GPUS)" PASS; else result nccl-tests FAIL; fi

# --- 4. calibrate
run calibrate 120 env MESHPLAN_CALIBRATE_QUICK=1 "$B/bin/meshplan" calibrate --backend cuda -o "$OUTDIR/overlay.yaml"
if [ "$rc" = 0 ] && [ -s "$OUTDIR/overlay.yaml" ]; then result calibrate PASS; else result calibrate FAIL; fi

# --- 5. PyTorch comparison (bf16 matmul vs meshplan's cuBLASLt; GPT-2 baseline)
PY=${PYTHON:-python3}
if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
    # PyTorch may live in a venv: try the python next to the NCCL wheel.
    for site in $(grep '/site-packages/nvidia/nccl/lib/libnccl.so.2$' "$OUTDIR/libraries.txt"); do
        cand="${site%%/lib/python*}/bin/python"
        if [ -x "$cand" ] && "$cand" -c 'import torch' >/dev/null 2>&1; then
            PY=$cand
            break
        fi
    done
fi
say "python: $PY"
if ! "$PY" -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1; then
    result "torch (no CUDA PyTorch for $PY)" SKIP
else
    run torch "$((BUDGET))" "$PY" benches/python/torch_gpu.py --meshplan "$OUTDIR/calibrate.txt" \
        --json "$OUTDIR/torch_gpu.json" --meshplan-train "$OUTDIR/gpt2-cuda.json"
    case $rc in
        0) result torch PASS ;;
        2) result "torch (meshplan GEMM below 90% of PyTorch)" FAIL ;;
        *) result torch FAIL ;;
    esac
fi

say ""
say "gpu-check summary (${SECONDS}s):"
for s in "${summary[@]}"; do say "  $s"; done
if [ -n "${OUT:-}" ]; then
    tar -czf "$OUT/gpu-check.tgz" -C "$OUTDIR" . && say "packed $OUT/gpu-check.tgz"
fi
exit $failed
