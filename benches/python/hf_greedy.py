"""Greedy generation with Hugging Face `transformers`, to cross-check `meshplan run`
by hand on a checkpoint directory (not run by the tests, which carry their own f64
reference forward passes).

    python benches/python/hf_greedy.py DIR --prompt-ids 1,15,42 --max-new-tokens 8
    cargo run --release -- run PLAN --weights DIR --prompt-ids 1,15,42 --max-new-tokens 8 --json

prints one JSON object with `tokens` (generated ids) and `logits` (fp32 logits the
last token was chosen from), the keys `meshplan run --json` prints.
"""

import argparse
import json

import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    args = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, torch_dtype=torch.float32)
    model.eval()
    ids = [int(x) for x in args.prompt_ids.split(",") if x]
    seq = torch.tensor([ids])
    out, logits = [], None
    with torch.no_grad():
        for _ in range(args.max_new_tokens):
            logits = model(seq).logits[0, -1]
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    print(json.dumps({"tokens": out, "logits": logits.tolist()}))


if __name__ == "__main__":
    main()
