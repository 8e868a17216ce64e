"""GPT-2 checkpoints against meshplan.

| case | field | expected |
|---|---|---|
| gpt2-gelu_new (base), gpt2-gelu_pytorch_tanh, gpt2-gelu_fast, gpt2-gelu_accurate, gpt2-gelu_python_tanh | tanh-approximated GELU | exact |
| gpt2-gelu, gpt2-gelu_python, gpt2-gelu_10 | exact (erf) GELU (gelu_10: clipped to [-10, 10]) | refused, naming activation_function |
| gpt2-no-scale | scale_attn_weights: false | refused, naming scale_attn_weights |
| gpt2-inverse-layer-idx | scale_attn_by_inverse_layer_idx: true | refused, naming scale_attn_by_inverse_layer_idx |
| gpt2-reorder-upcast | reorder_and_upcast_attn: true (fp32: same math) | exact |
| gpt2-untied | tie_word_embeddings: false (own lm_head) | exact |
| gpt2-n-inner | n_inner: 80 | exact |
| gpt2-ln-eps | layer_norm_epsilon: 0.5 | exact |
| gpt2-last-position | 24 new tokens after a 9-token prompt: every position of n_positions 32 fed (the last new token is not) | exact |
| gpt2-padded-vocab | vocab_size: 125, planned with --make-vocab-size-divisible-by 48 (144 rows, 36 a rank at tp=4: the last holds 17 tokens and 19 padded rows) | exact |
| gpt2-eos-outside-vocab | GPT2Config's default eos_token_id 50256, outside a vocabulary of 128 (never generated) | exact |
| gpt2-relu, gpt2-quick_gelu | other activation_function values | refused, naming activation_function |
"""

import hfcheck
from hfcheck import Case, Refuse, reload_with

MORE_PLANS = tuple(hfcheck.PLANS) + ("tp4", "tp2pp2dp2")

TANH = ["gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate", "gelu_python_tanh"]
ERF = ["gelu", "gelu_python", "gelu_10"]

CASES = [
    *[
        Case(
            f"gpt2-{act}",
            "gpt2",
            {"activation_function": act},
            # Each would be caught computed the other way (erf for tanh, tanh for erf).
            contrast=reload_with(activation_function="gelu" if act in TANH else "gelu_new"),
            plans=MORE_PLANS if act in ("gelu_new", "gelu") else tuple(hfcheck.PLANS),
            seed_of="gpt2-act",
            expect="exact" if act in TANH else Refuse("activation_function"),
        )
        for act in TANH + ERF
    ],
    Case(
        "gpt2-no-scale",
        "gpt2",
        {"scale_attn_weights": False},
        expect=Refuse("scale_attn_weights"),
        contrast=reload_with(scale_attn_weights=True),
    ),
    Case(
        "gpt2-inverse-layer-idx",
        "gpt2",
        {"scale_attn_by_inverse_layer_idx": True, "n_layer": 3},
        expect=Refuse("scale_attn_by_inverse_layer_idx"),
        contrast=reload_with(scale_attn_by_inverse_layer_idx=False),
    ),
    Case("gpt2-reorder-upcast", "gpt2", {"reorder_and_upcast_attn": True}),
    Case("gpt2-untied", "gpt2", {"tie_word_embeddings": False}, plans=MORE_PLANS),
    Case("gpt2-n-inner", "gpt2", {"n_inner": 80}),
    Case(
        "gpt2-ln-eps",
        "gpt2",
        {"layer_norm_epsilon": 0.5},
        contrast=reload_with(layer_norm_epsilon=1e-5),
    ),
    Case("gpt2-last-position", "gpt2", {}, new_tokens=24, seed_of="gpt2-act"),
    Case(
        "gpt2-padded-vocab",
        "gpt2",
        {"vocab_size": 125},
        plans=MORE_PLANS,
        plan_flags=("--make-vocab-size-divisible-by", "48"),
    ),
    Case("gpt2-eos-outside-vocab", "gpt2", {"eos_token_id": 50256, "bos_token_id": 50256}),
    Case("gpt2-relu", "gpt2", {"activation_function": "relu"}, expect=Refuse("activation_function")),
    Case(
        "gpt2-quick_gelu",
        "gpt2",
        {"activation_function": "quick_gelu"},
        expect=Refuse("activation_function"),
    ),
]

globals().update(hfcheck.tests(CASES))
