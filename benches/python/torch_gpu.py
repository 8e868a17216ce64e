#!/usr/bin/env python3
"""PyTorch baselines on a GPU, for scripts/gpu-check.sh.

(a) bf16 matmul TFLOP/s (torch.matmul) on the cube shapes of `meshplan calibrate`'s
    GEMM sweep, beside meshplan's cuBLASLt numbers (parsed from calibrate's output
    with --meshplan FILE): meshplan must reach >= 90% of PyTorch on shapes >= 2048
    (exit 2 otherwise).
(b) GPT-2 124M training (seq 1024, bf16 autocast, fused AdamW) tokens/s and MFU,
    eager and torch.compile: the baseline the CUDA interpreter must beat.
    models/gpt2-124m.yaml trains 512 sequences of 1024 tokens per step; here a step
    is --micro-batch sequences x --accum micro-steps (tokens/s does not depend on
    how the global batch is split).
"""

import argparse
import json
import math
import re
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

SIDES = [256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384]


def peak_bf16_tflops(name):
    """Dense bf16 peak of the device, for MFU."""
    n = name.upper()
    if "H100" in n or "H200" in n or "H800" in n or "GH200" in n:
        return 989.0 if "PCIE" not in n else 756.0
    if "B200" in n:
        return 2250.0
    if "A100" in n:
        return 312.0
    return float("nan")


def matmul_sweep(repeats=20, warmup=5):
    out = {}
    for s in SIDES:
        a = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
        for _ in range(warmup):
            torch.matmul(a, b)
        times = []
        for _ in range(repeats):
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            torch.matmul(a, b)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        times.sort()
        t = times[len(times) // 2]
        out[s] = 2.0 * s**3 / t / 1e12
        del a, b
    return out


def parse_meshplan(path):
    """{side: TFLOP/s} from `meshplan calibrate`'s GEMM table (m n k ms TFLOP/s)."""
    got = {}
    try:
        text = open(path).read()
    except OSError:
        return got
    in_gemm = False
    for line in text.splitlines():
        if line.startswith("GEMM"):
            in_gemm = True
            continue
        if in_gemm and not line.strip():
            break
        m = re.match(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s*$", line)
        if in_gemm and m and m.group(1) == m.group(2) == m.group(3):
            got[int(m.group(1))] = float(m.group(5))
    return got


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, vocab=50304, seq=1024, d=768, layers=12, heads=12):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        # GPT-2's initialisation (normal, std 0.02; zero biases), as meshplan's seeded
        # weights: the loss starts near ln(vocab), not at PyTorch's default init's ~100.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def train_bench(compile_, micro_batch, accum, steps, seq=1024):
    torch.manual_seed(0)
    model = GPT2(seq=seq).cuda()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, fused=True)
    fwd = torch.compile(model) if compile_ else model
    x = torch.randint(0, 50257, (micro_batch, seq), device="cuda")
    y = torch.randint(0, 50257, (micro_batch, seq), device="cuda")

    def step():
        for _ in range(accum):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fwd(x, y) / accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(2):  # warm-up (and compilation)
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    tokens = steps * accum * micro_batch * seq
    # 6N per token for the weights, 12 L d T for attention (PaLM's count).
    flops_per_token = 6 * n_params + 12 * 12 * 768 * seq
    tps = tokens / dt
    return {
        "params": n_params,
        "tokens_per_s": tps,
        "tflops": tps * flops_per_token / 1e12,
        "loss": float(loss) * accum,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--meshplan", help="meshplan calibrate's output, for the GEMM comparison")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument(
        "--meshplan-train",
        help="`meshplan run --backend cuda --json` of the same GPT-2 workload, printed beside",
    )
    args = ap.parse_args()

    name = torch.cuda.get_device_name(0)
    peak = peak_bf16_tflops(name)
    print(f"device: {name}; torch {torch.__version__}; bf16 peak {peak} TFLOP/s")
    torch.backends.cuda.matmul.allow_tf32 = True
    results = {"device": name, "torch": torch.__version__}

    ours = parse_meshplan(args.meshplan) if args.meshplan else {}
    theirs = matmul_sweep()
    results["matmul_tflops"] = theirs
    results["meshplan_gemm_tflops"] = ours
    print("\nbf16 matmul, TFLOP/s (meshplan = cuBLASLt through Gpu::gemm)")
    print(f"{'side':>7} {'torch':>9} {'meshplan':>9} {'ratio':>7}")
    low = []
    for s in SIDES:
        m = ours.get(s)
        ratio = m / theirs[s] if m else float("nan")
        flag = ""
        if m is not None and s >= 2048 and ratio < 0.9:
            low.append(s)
            flag = "  < 90%"
        print(f"{s:>7} {theirs[s]:>9.1f} {m if m else float('nan'):>9.1f} {ratio:>7.2f}{flag}")
    if not ours:
        print("(no meshplan numbers: pass --meshplan with calibrate's output)")

    if not args.skip_train:
        print(f"\nGPT-2 124M training, seq 1024, micro-batch {args.micro_batch} x accum {args.accum}, bf16 autocast, fused AdamW")
        for mode in ("eager", "compile"):
            try:
                r = train_bench(mode == "compile", args.micro_batch, args.accum, args.steps)
            except Exception as e:  # torch.compile may be unavailable (no triton)
                print(f"{mode:>8}: failed: {e}")
                results[f"gpt2_{mode}"] = {"error": str(e)}
                continue
            mfu = r["tflops"] / peak if not math.isnan(peak) else float("nan")
            r["mfu"] = mfu
            results[f"gpt2_{mode}"] = r
            print(f"{mode:>8}: {r['tokens_per_s']:>10.0f} tokens/s, {r['tflops']:.1f} TFLOP/s, MFU {mfu:.1%} (loss {r['loss']:.3f})")

    if args.meshplan_train:
        try:
            with open(args.meshplan_train) as f:
                run = json.load(f)
            # The same model (vocabulary padded to 50304, as gpu-check.sh runs it):
            # the same FLOPs per token.
            tps = run["measured"]["tokens_per_s"]
            n_params = results.get("gpt2_eager", {}).get("params", 124_475_904)
            tflops = tps * (6 * n_params + 12 * 12 * 768 * 1024) / 1e12
            mfu = tflops / peak if not math.isnan(peak) else float("nan")
            results["gpt2_meshplan"] = {"tokens_per_s": tps, "tflops": tflops, "mfu": mfu, "loss": run["loss"]}
            print(f"{'meshplan':>8}: {tps:>10.0f} tokens/s, {tflops:.1f} TFLOP/s, MFU {mfu:.1%} (run --backend cuda, median step)")
            for mode in ("eager", "compile"):
                other = results.get(f"gpt2_{mode}", {}).get("tokens_per_s")
                if other:
                    print(f"          meshplan / torch {mode}: {tps / other:.2f}x")
        except (OSError, ValueError, KeyError) as e:
            print(f"meshplan training numbers unreadable ({args.meshplan_train}): {e}")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if low:
        print(f"\nFAIL: meshplan's GEMM is below 90% of PyTorch at sides {low}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
