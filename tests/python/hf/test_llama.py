"""Llama checkpoints (transformers `LlamaForCausalLM`) against meshplan.

Each case is one field or variant. Expectation per field (the lead makes the Rust
side match, or flips a case to `Refuse(...)` if meshplan is to refuse it instead):

| case | field | expected |
|---|---|---|
| llama-gqa/mha/mqa | num_key_value_heads 2/4/1 | exact (tp4: KV heads replicated) |
| llama-tied | tie_word_embeddings: true | exact |
| llama-head-dim | head_dim != hidden/heads | exact |
| llama-rms-eps | rms_norm_eps | exact |
| llama-rope-theta | rope_parameters.rope_theta | exact |
| llama-attention-bias | attention_bias: true (q/k/v and o_proj biases) | exact |
| llama-mlp-bias | mlp_bias: true | exact |
| llama-rope-linear | rope_type linear | exact |
| llama-rope-llama3 | rope_type llama3 (Llama 3.1) | exact |
| llama-rope-llama3-tf4 | the same in the Transformers 4 spelling (`rope_scaling`, top-level `rope_theta`, `torch_dtype`) | exact |
| llama-rope-linear-tf4-type | `rope_scaling: {"type": "linear"}` (older spelling) | exact |
| llama-rope-yarn | rope_type yarn (default betas, attention factor from factor) | refused, naming rope_parameters |
| llama-rope-yarn-explicit | yarn with attention_factor, beta_fast/slow, truncate: false | refused, naming rope_parameters |
| llama-rope-proportional | rope_type proportional with partial_rotary_factor 0.5 | refused, naming rope_parameters |
| llama-rope-dynamic | rope_type dynamic, a sequence past max_position_embeddings | refused, naming rope_parameters |
| llama-rope-longrope | rope_type longrope, a sequence past original_max_position_embeddings | refused, naming rope_parameters |
| llama-hidden-act-gelu | hidden_act: gelu | refused, naming hidden_act |
| llama-bf16-storage | tensors stored as bf16 (compute in fp32) | exact |
| llama-sharded | several *.safetensors files with an index | exact |
"""

import hfcheck
from hfcheck import Case, Refuse, reload_with, zeroed

THETA = 10000.0
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": THETA}
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": THETA,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # head_dim 16: wavelengths 6.3 (kept), 20 and 63 (smoothed), 198 and up (/ factor).
    "original_max_position_embeddings": 64,
}
MORE_PLANS = tuple(hfcheck.PLANS) + ("tp4", "tp2pp2dp2")


def tf4_llama3(c):
    """Transformers 4 spelling: `rope_scaling` and top-level `rope_theta`."""
    rp = c.pop("rope_parameters")
    c["rope_theta"] = rp.pop("rope_theta")
    c["rope_scaling"] = rp
    c["torch_dtype"] = c.pop("dtype", "float32")


def tf4_linear_type(c):
    """Older Transformers 4 spelling: `rope_scaling: {"type": ...}`."""
    rp = c.pop("rope_parameters")
    c["rope_theta"] = rp["rope_theta"]
    c["rope_scaling"] = {"type": rp["rope_type"], "factor": rp["factor"]}


CASES = [
    Case("llama-gqa", "llama", plans=MORE_PLANS),
    Case("llama-mha", "llama", {"num_key_value_heads": 4}),
    Case("llama-mqa", "llama", {"num_key_value_heads": 1}, plans=MORE_PLANS),
    Case("llama-tied", "llama", {"tie_word_embeddings": True}),
    Case("llama-head-dim", "llama", {"head_dim": 32}),
    Case("llama-rms-eps", "llama", {"rms_norm_eps": 0.5}, contrast=reload_with(rms_norm_eps=1e-5)),
    Case(
        "llama-rope-theta",
        "llama",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}},
        contrast=reload_with(rope_parameters=dict(DEFAULT_ROPE)),
    ),
    Case(
        "llama-attention-bias",
        "llama",
        {"attention_bias": True},
        contrast=zeroed("self_attn.o_proj.bias"),
    ),
    Case("llama-mlp-bias", "llama", {"mlp_bias": True}, contrast=zeroed("mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")),
    Case(
        "llama-rope-linear",
        "llama",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": THETA, "factor": 4.0}},
        contrast=reload_with(rope_parameters=dict(DEFAULT_ROPE)),
    ),
    Case(
        "llama-rope-llama3",
        "llama",
        {"rope_parameters": dict(LLAMA3)},
        contrast=reload_with(rope_parameters=dict(DEFAULT_ROPE)),
        plans=MORE_PLANS,
    ),
    Case(
        "llama-rope-llama3-tf4",
        "llama",
        {"rope_parameters": dict(LLAMA3)},
        edit_config=tf4_llama3,
        contrast=reload_with(rope_parameters=dict(DEFAULT_ROPE)),
        seed_of="llama-rope-llama3",
    ),
    Case(
        "llama-rope-linear-tf4-type",
        "llama",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": THETA, "factor": 4.0}},
        edit_config=tf4_linear_type,
        contrast=reload_with(rope_parameters=dict(DEFAULT_ROPE)),
        seed_of="llama-rope-linear",
    ),
    Case(
        "llama-rope-yarn",
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": THETA,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
        expect=Refuse("rope_parameters"),
        contrast=reload_with(rope_parameters=dict(DEFAULT_ROPE)),
    ),
    Case(
        "llama-rope-yarn-explicit",
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": THETA,
                "factor": 8.0,
                "original_max_position_embeddings": 16,
                "attention_factor": 1.3,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "truncate": False,
            }
        },
        expect=Refuse("rope_parameters"),
        contrast=reload_with(rope_parameters=dict(DEFAULT_ROPE)),
    ),
    Case(
        "llama-rope-proportional",
        "llama",
        {
            "rope_parameters": {
                "rope_type": "proportional",
                "rope_theta": THETA,
                "factor": 2.0,
                "partial_rotary_factor": 0.5,
            }
        },
        expect=Refuse("rope_parameters"),
        contrast=reload_with(rope_parameters=dict(DEFAULT_ROPE)),
    ),
    Case(
        "llama-rope-dynamic",
        "llama",
        {
            "max_position_embeddings": 12,
            "rope_parameters": {"rope_type": "dynamic", "rope_theta": THETA, "factor": 4.0},
        },
        expect=Refuse("rope_parameters"),
        contrast=reload_with(rope_parameters=dict(DEFAULT_ROPE)),
    ),
    Case(
        "llama-rope-longrope",
        "llama",
        {
            "max_position_embeddings": 48,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": THETA,
                "original_max_position_embeddings": 12,
                "short_factor": [1.0, 1.1, 1.2, 1.4, 1.6, 2.0, 2.5, 3.0],
                "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
            },
        },
        expect=Refuse("rope_parameters"),
        contrast=reload_with(rope_parameters=dict(DEFAULT_ROPE)),
    ),
    Case(
        "llama-hidden-act-gelu",
        "llama",
        {"hidden_act": "gelu"},
        expect=Refuse("hidden_act"),
        contrast=reload_with(hidden_act="silu"),
    ),
    Case("llama-bf16-storage", "llama", store_dtype=hfcheck.torch.bfloat16),
    Case("llama-sharded", "llama", max_shard_size="40KB"),
]

globals().update(hfcheck.tests(CASES))


def test_tf4_spellings_load_as_tf5(built):
    """The Transformers 4 spellings are the same model to transformers (so their
    cases test meshplan's reading of them, not transformers')."""
    by_id = {c.id: c for c in CASES}
    for tf4, tf5 in [
        ("llama-rope-llama3-tf4", "llama-rope-llama3"),
        ("llama-rope-linear-tf4-type", "llama-rope-linear"),
    ]:
        a, b = built(by_id[tf4]), built(by_id[tf5])
        assert a.ref.tokens == b.ref.tokens, tf4
        d = max(hfcheck.max_diff(x, y) for x, y in zip(a.ref.logits[0], b.ref.logits[0]))
        assert d == 0.0, f"{tf4}: {d}"
