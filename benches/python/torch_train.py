"""PyTorch eager twin of the meshplan CPU training benchmark (benches/benches/train.rs).

Measures CPU training tokens/s of models/small-gpt.yaml in PyTorch eager, fp32:
a Llama-style GPT of 6 layers, hidden 384, 6 heads (kv_heads = heads, so no
key/value head repetition), SwiGLU FFN 1536, RMSNorm, RoPE (rotate-half,
theta 10000), vocabulary 4096, untied head; one step = forward + backward +
AdamW on 8 sequences of 256 tokens, the whole global batch, as the Rust bench.
With --model small-gpt2, models/small-gpt2.yaml instead: the same shape with
GPT-2's block (LayerNorm with biases, GELU with the tanh approximation, biased
linears, a learned position table, the head tied to the embedding).

For each thread count T in 1 and 2: torch.set_num_threads(T) (intra-op threads,
the only parallelism the step has) with one inter-op thread, 2 warm-up steps,
then 10 timed steps; prints one JSON object with the median step time and
tokens/s per thread count.

Run (PyTorch is only for this comparison, not a project dependency; see
benches/python/README.md):

    python benches/python/torch_train.py            # threads 1 and 2
    python benches/python/torch_train.py --threads 1 --steps 5
    python benches/python/torch_train.py --model small-gpt2
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

# models/small-gpt.yaml
LAYERS, HIDDEN, HEADS, FFN, VOCAB = 6, 384, 6, 1536, 4096
SEQ, BATCH = 256, 8
THETA, EPS = 10000.0, 1e-5  # the ir crate's defaults for rope_theta and norm_eps
LR = 3e-3  # TrainOptions::default().lr


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Written out rather than nn.RMSNorm so older PyTorch releases run it too.
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight


def rope_tables(seq, head_dim):
    inv = THETA ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ang = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)  # rotate-half pairs i with i + head_dim/2
    return ang.cos(), ang.sin()


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.norm1 = RMSNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)  # fused Q|K|V
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.norm2 = RMSNorm(HIDDEN)
        self.gate_up = nn.Linear(HIDDEN, 2 * FFN, bias=False)  # fused gate|up
        self.down = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [b, heads, s, head_dim]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, HIDDEN))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class SmallGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)  # untied
        cos, sin = rope_tables(SEQ, HIDDEN // HEADS)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


class Gpt2Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.norm1 = nn.LayerNorm(HIDDEN, eps=EPS)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)  # fused Q|K|V, biased
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.norm2 = nn.LayerNorm(HIDDEN, eps=EPS)
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, HIDDEN))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class SmallGPT2(nn.Module):
    """models/small-gpt2.yaml."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.positions = nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(Gpt2Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN, eps=EPS)
        self.register_buffer("pos", torch.arange(SEQ), persistent=False)
        # GPT-2's initialisation of the tables (the head reads the token table).
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.01)

    def forward(self, tokens, targets):
        x = self.embed(tokens) + self.positions(self.pos)
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.norm(x), self.embed.weight)  # tied head
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


MODELS = {"small-gpt": SmallGPT, "small-gpt2": SmallGPT2}


def bench(threads, warmup, steps, model_name="small-gpt"):
    torch.set_num_threads(threads)
    torch.manual_seed(1234)
    model = MODELS[model_name]()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    inp, tgt = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(inp, tgt)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t
        if i >= warmup:
            times.append(dt)
    med = statistics.median(times)
    return {
        "threads": threads,
        "median_step_s": med,
        "tokens_per_s": BATCH * SEQ / med,
        # Other load on a shared machine only slows steps down: the fastest step
        # is the least disturbed figure.
        "min_step_s": min(times),
        "tokens_per_s_fastest": BATCH * SEQ / min(times),
        "step_s": times,
        "final_loss": loss.item(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--model", choices=sorted(MODELS), default="small-gpt")
    args = ap.parse_args()
    # Must be set before any inter-op work starts; only intra-op threads vary.
    torch.set_num_interop_threads(1)
    results = [bench(t, args.warmup, args.steps, args.model) for t in args.threads]
    print(
        json.dumps(
            {
                "model": args.model,
                "torch": torch.__version__,
                "tokens_per_step": BATCH * SEQ,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
