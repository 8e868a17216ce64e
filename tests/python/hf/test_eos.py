"""Generation stops at EOS as transformers' `generate` does: the EOS token is the
last token of the request, and the other request (no EOS) goes on.

Each case first generates without an EOS, then sets `eos_token_id` to the token the
first prompt's greedy generation gives at step `eos_step` (or the first later step
with a token not seen before), so transformers stops there. Known wrong today:
meshplan ignores eos_token_id.

| case | where the EOS is given | expected |
|---|---|---|
| llama-eos | config.json eos_token_id (int), hit at step 2 | exact |
| llama-eos-step0 | config.json, hit by the first token (from the prefill) | exact |
| llama-eos-list | config.json eos_token_id: [never generated, hit] (Llama 3 style) | exact |
| llama-eos-generation-config | only generation_config.json (config.json: null) | exact |
| qwen2-eos | config.json, hit at step 3 | exact |
| gpt2-eos | config.json (untied head), hit at step 1 | exact |
"""

import hfcheck
from hfcheck import Case

CASES = [
    Case("llama-eos", "llama", eos_step=2),
    Case("llama-eos-step0", "llama", eos_step=0),
    Case("llama-eos-list", "llama", eos_step=2, eos_list=True),
    Case("llama-eos-generation-config", "llama", eos_step=2, eos_in="generation_config"),
    Case("qwen2-eos", "qwen2", eos_step=3),
    Case("gpt2-eos", "gpt2", {"tie_word_embeddings": False}, eos_step=1),
]

globals().update(hfcheck.tests(CASES))


def test_eos_cuts_the_reference(built):
    """Each case's EOS makes transformers stop early on the first prompt."""
    for c in CASES:
        b = built(c)
        n = len(b.ref.tokens[0])
        assert n < c.new_tokens, (c.id, b.ref.tokens)
        assert b.ref.tokens[0] == b.free.tokens[0][:n], (c.id, b.ref.tokens, b.free.tokens)
