"""Mistral and Qwen2 checkpoints against meshplan.

| case | field | expected |
|---|---|---|
| mistral | sliding_window: null | exact |
| mistral-window | sliding_window: 4, first prompt 9 tokens, 15 positions in all | refused, naming sliding_window |
| mistral-window-wide | sliding_window: 32, wider than every sequence | exact |
| qwen2 | q/k/v biases, no o_proj bias | exact |
| qwen2-tied | tie_word_embeddings: true (Qwen2-0.5B style) | exact |
| qwen2-sliding | use_sliding_window: true, sliding_window 4, max_window_layers 1 (layer 0 full, layer 1 windowed: `layer_types`) | refused, naming sliding_window |
"""

import hfcheck
from hfcheck import Case, Refuse, reload_with, zeroed

MORE_PLANS = tuple(hfcheck.PLANS) + ("tp4", "tp2pp2dp2")

CASES = [
    Case("mistral", "mistral"),
    Case(
        "mistral-window",
        "mistral",
        {"sliding_window": 4},
        expect=Refuse("sliding_window"),
        contrast=reload_with(sliding_window=None),
        plans=MORE_PLANS,
    ),
    Case("mistral-window-wide", "mistral", {"sliding_window": 32}),
    Case(
        "qwen2",
        "qwen2",
        contrast=zeroed("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        plans=MORE_PLANS,
    ),
    Case("qwen2-tied", "qwen2", {"tie_word_embeddings": True}),
    Case(
        "qwen2-sliding",
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
        expect=Refuse("sliding_window"),
        contrast=reload_with(
            use_sliding_window=False,
            sliding_window=None,
            layer_types=["full_attention", "full_attention"],
        ),
    ),
]

globals().update(hfcheck.tests(CASES))
