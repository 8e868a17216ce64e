"""Helpers of the Hugging Face fidelity suite: tiny random checkpoints made with
`transformers`, their greedy generations (the reference), and `meshplan plan` /
`meshplan run --json` on them.

A case is a model family, a base config and the fields the case changes. The suite
saves the model with `save_pretrained` (safetensors), loads it back with
`from_pretrained` in fp32 with eager attention and generates greedily with
`generate` (KV cache, stopping at EOS as transformers does, `output_logits=True` for
the raw logits of every step). meshplan plans the same `config.json` on the CPU test
mesh (`topologies/cpu-test-mesh.yaml` cut to the plan's ranks) and runs it with
`--weights DIR --json`.

Per-step logits: `meshplan run --json --step-logits` prints every request's tokens,
its logits at every step and its `finish_reason` (`eos` or `length`), so one run per
plan compares every step of every request.

HFCHECK_LOG=FILE appends, per plan run, the largest logit difference seen (the
margin of the passing cases against the tolerance).
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
MESH = ROOT / "topologies" / "cpu-test-mesh.yaml"

# Max abs difference allowed between meshplan's and transformers' fp32 logits.
TOL = 1e-4
# A case's field must move transformers' own logits by at least this much (ten
# times the tolerance) against what ignoring it computes, or change its tokens:
# else the case could not catch a silent difference.
SENSITIVITY = 1e-3

# The plans every exact case runs on (`--config`), and the ranks each needs.
PLANS = {
    "single": "tp=1,pp=1,dp=1",
    "tp2": "tp=2,pp=1,dp=1",
    "pp2": "tp=1,pp=2,dp=1",
    "dp2": "tp=1,pp=1,dp=2",
}
EXTRA_PLANS = {
    "tp4": "tp=4,pp=1,dp=1",
    "tp2pp2dp2": "tp=2,pp=2,dp=2",
}
# A model with routed experts: on one rank, its experts split over tp, over
# pipeline stages, and over ep (inside the data axis, and across the tensor ranks);
# the search would otherwise take DP-attention, which `run` refuses.
MOE_PLANS = {
    "moe-single": "tp=1,pp=1,dp=1,dp_attention=false",
    "moe-tp2": "tp=2,pp=1,dp=1,ep=1,dp_attention=false",
    "moe-pp2": "tp=1,pp=2,dp=1,dp_attention=false",
    "moe-dp2ep2": "tp=1,pp=1,dp=2,ep=2,dp_attention=false",
    "moe-tp2ep2": "tp=2,pp=1,dp=1,ep=2,dp_attention=false",
}
ALL_PLANS = {**PLANS, **EXTRA_PLANS, **MOE_PLANS}

# Two requests: the first longer than a sliding window of 4, the second short (on a
# dp=2 plan each replica gets one; every plan decodes them side by side).
PROMPTS = ([3, 17, 42, 7, 99, 5, 64, 23, 11], [8, 120, 33])
NEW_TOKENS = 6


def meshplan_bin() -> Path:
    p = Path(os.environ.get("MESHPLAN_BIN", "target/release/meshplan"))
    return p if p.is_absolute() else ROOT / p


# === configs ===

BASE = {
    "llama": dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=128,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        hidden_act="silu",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    ),
    "gpt2": dict(
        n_embd=64,
        n_head=4,
        n_layer=2,
        n_positions=32,
        vocab_size=128,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    ),
}
BASE["mistral"] = {**BASE["llama"], "sliding_window": None}
BASE["qwen2"] = {**BASE["llama"], "use_sliding_window": False}
BASE["mixtral"] = {**BASE["mistral"], "num_local_experts": 4, "num_experts_per_tok": 2}
BASE["qwen3"] = {**BASE["llama"]}
BASE["deepseek_v3"] = {
    **{k: v for k, v in BASE["llama"].items() if k not in ("num_key_value_heads",)},
    "num_key_value_heads": 4,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}


@dataclass
class Refuse:
    """The case expects meshplan to exit 2 naming `field` (in plan or run)."""

    field: str


@dataclass
class Case:
    id: str
    family: str
    config: dict = field(default_factory=dict)
    # "exact", or Refuse(field).
    expect: object = "exact"
    plans: tuple = tuple(PLANS)
    # What a silent difference would compute, for the sensitivity check: a function
    # of the case's checkpoint directory returning a transformers model.
    contrast: Callable | None = None
    # Edits config.json after saving (e.g. the Transformers 4 spelling); the
    # reference loads the edited file.
    edit_config: Callable | None = None
    generation_config: dict | None = None
    store_dtype: torch.dtype = torch.float32
    max_shard_size: str | None = None
    # eos: pick eos_token_id(s) from the case's own greedy output (see eos_from_step).
    eos_step: int | None = None
    eos_list: bool = False
    # More `meshplan plan` flags (e.g. --make-vocab-size-divisible-by).
    plan_flags: tuple = ()
    eos_in: str = "config"  # "config" or "generation_config"
    new_tokens: int = NEW_TOKENS
    # The weights of another case (same seed): for spellings of one model.
    seed_of: str | None = None

    def seed(self) -> int:
        return zlib.crc32((self.seed_of or self.id).encode())


# === checkpoints ===


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Replaces every parameter with seeded values of a size that keeps activations
    O(1): a model at transformers' initializer_range (0.02) computes nearly linear
    functions, where erf and tanh GELU or a missing bias differ by less than the
    tolerance."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape
            if p.dim() == 1:
                is_norm = "norm" in name or "ln_" in name
                if is_norm and name.endswith("weight"):
                    v = 1.0 + 0.3 * torch.randn(shape, generator=g)
                else:
                    v = 0.2 * torch.randn(shape, generator=g)
            elif "embed" in name or "wte" in name or "wpe" in name:
                # Small enough that a tied head does not just repeat the last token.
                v = 0.35 * torch.randn(shape, generator=g)
            else:
                # nn.Linear is [out, in]; GPT-2's Conv1D is [in, out].
                fan_in = shape[0] if ".c_" in name else shape[1]
                if "mlp.c_proj" in name:
                    gain = 3.0  # GPT-2: erf and tanh GELU differ by < 5e-4 a unit
                elif "lm_head" in name or "mlp" in name:
                    gain = 2.0
                else:
                    gain = 1.4
                v = gain * torch.randn(shape, generator=g) / math.sqrt(fan_in)
            p.copy_(v.to(p.dtype))


def build_config(case: Case, eos=None):
    from transformers import AutoConfig

    cfg = copy.deepcopy(BASE[case.family])
    cfg.update(copy.deepcopy(case.config))
    if eos is not None and case.eos_in == "config":
        cfg["eos_token_id"] = eos
    return AutoConfig.for_model(case.family, **cfg)


def save_checkpoint(case: Case, out: Path, eos=None) -> Path:
    """Writes the case's checkpoint to `out` (config.json, *.safetensors,
    generation_config.json) and returns `out`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    cfg = build_config(case, eos)
    torch.manual_seed(case.seed())
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    randomize(model, case.seed())
    if case.store_dtype != torch.float32:
        model = model.to(case.store_dtype)
    out.mkdir(parents=True, exist_ok=True)
    kw = {"max_shard_size": case.max_shard_size} if case.max_shard_size else {}
    model.save_pretrained(out, **kw)
    gen = dict(case.generation_config or {})
    if eos is not None and case.eos_in == "generation_config":
        gen["eos_token_id"] = eos
    if gen or not (out / "generation_config.json").exists():
        g = GenerationConfig.from_model_config(model.config)
        for k, v in gen.items():
            setattr(g, k, v)
        g.save_pretrained(out)
    if case.edit_config is not None:
        path = out / "config.json"
        c = json.loads(path.read_text())
        case.edit_config(c)
        path.write_text(json.dumps(c, indent=2))
    return out


def load(dir: Path, **overrides):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(
        dir, dtype=torch.float32, attn_implementation="eager", **overrides
    )
    return m.eval()


@dataclass
class Generation:
    tokens: list  # per prompt: generated ids (EOS included when hit)
    logits: list  # per prompt: per step, fp32 numpy [vocab]


def generate(model, n: int, prompts=PROMPTS) -> Generation:
    """Greedy generation as transformers does it (KV cache, the checkpoint's
    generation_config.json, stop at EOS), one prompt at a time."""
    toks, logs = [], []
    for p in prompts:
        ids = torch.tensor([list(p)])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                output_logits=True,
                return_dict_in_generate=True,
            )
        toks.append(out.sequences[0, len(p):].tolist())
        logs.append([l[0].float().numpy().copy() for l in out.logits])
    return Generation(toks, logs)


def max_diff(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return math.inf
    return float(np.max(np.abs(a - b))) if a.size else 0.0


# === meshplan ===


def mesh_file(dir: Path, ranks: int) -> Path:
    """The CPU test mesh with exactly `ranks` GPUs on its one node."""
    p = dir / f"mesh-{ranks}.yaml"
    if not p.exists():
        text = MESH.read_text()
        lines = [
            f"gpus_per_node: {ranks}" if l.startswith("gpus_per_node:") else l
            for l in text.splitlines()
        ]
        assert any(l.startswith("gpus_per_node:") for l in text.splitlines()), MESH
        p.write_text("\n".join(lines) + "\n")
    return p


def ranks_of(cfg: str) -> int:
    n = 1
    for kv in cfg.split(","):
        k, v = kv.split("=")
        # ep splits the experts over ranks of dp and tp: it adds none.
        if k in ("tp", "pp", "dp", "cp"):
            n *= int(v)
    return n


@dataclass
class Proc:
    argv: list
    rc: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return f"`{' '.join(map(str, self.argv))}` exited {self.rc}:\n{self.stderr.strip()[-2000:]}"


def meshplan(*args, timeout=120) -> Proc:
    argv = [str(meshplan_bin()), *map(str, args)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return Proc(argv, r.returncode, r.stdout, r.stderr)


def plan(
    ckpt: Path, plan_cfg: str, work: Path, prompts=PROMPTS, new_tokens=NEW_TOKENS, flags=()
) -> tuple[Path, Proc]:
    work.mkdir(parents=True, exist_ok=True)
    wl = work / "workload.yaml"
    wl.write_text(
        f"kind: inference\nprompt_len: {len(prompts[0])}\noutput_len: {new_tokens}\n"
        f"concurrency: {len(prompts)}\n"
    )
    out = work / "plan.json"
    p = meshplan(
        "plan",
        ckpt / "config.json",
        mesh_file(work.parent, ranks_of(plan_cfg)),
        "--workload",
        wl,
        "--config",
        plan_cfg,
        *flags,
        "-o",
        out,
    )
    return out, p


def run(plan_file: Path, ckpt: Path, k: int, prompts=PROMPTS) -> Proc:
    args = ["run", plan_file, "--weights", ckpt, "--json", "--step-logits", "--max-new-tokens", k]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    return meshplan(*args)


def compare_steps(plan_file: Path, ckpt: Path, ref: Generation, n: int, prompts=PROMPTS) -> list[str]:
    """Runs meshplan once for n new tokens and compares every request's tokens with
    transformers' (which may stop at EOS before n), its logits at every step with
    transformers' logits of that step, and its finish reason. Returns the
    differences found (empty: exact)."""
    problems = []
    worst = 0.0
    r = run(plan_file, ckpt, n, prompts)
    if r.rc != 0:
        return [r.describe()]
    v = json.loads(r.stdout)
    for i, want in enumerate(ref.tokens):
        req = v["requests"][i]
        got = req["tokens"]
        if got != want:
            first = next(
                (j for j in range(max(len(got), len(want))) if j >= len(got) or j >= len(want) or got[j] != want[j]),
                None,
            )
            why = ""
            if len(got) > len(want) and got[: len(want)] == want:
                why = ": transformers stopped at EOS, meshplan went on"
            elif len(got) < len(want) and want[: len(got)] == got:
                why = ": meshplan stopped early"
            problems.append(
                f"request {i} tokens {got} != transformers {want} (first difference at step {first}{why})"
            )
            continue
        # The EOS cases stop before the last step (eos_from), so a short output is EOS.
        want_reason = "eos" if len(want) < n else "length"
        if req["finish_reason"] != want_reason:
            problems.append(f"request {i}: finish_reason {req['finish_reason']!r}, transformers {want_reason!r}")
        steps = req["step_logits"]
        if len(steps) != len(want):
            problems.append(f"request {i}: {len(steps)} steps of logits for {len(want)} tokens")
            continue
        for step, (row, ref_row) in enumerate(zip(steps, ref.logits[i])):
            d = max_diff(row, ref_row)
            worst = max(worst, d)
            if d > TOL:
                problems.append(f"request {i}: logits of step {step} differ by {d:.3e} (tolerance {TOL:.0e})")
                # Later steps build on a diverged state: the first step that differs says it.
                break
    if os.environ.get("HFCHECK_LOG"):
        with open(os.environ["HFCHECK_LOG"], "a") as f:
            f.write(json.dumps({"plan": str(plan_file), "max_logit_diff": worst, "ok": not problems}) + "\n")
    return problems


# === the checks ===


def eos_from(free: Generation, case: Case):
    """An EOS the greedy generation of the first prompt hits at step `case.eos_step`
    or the first later step whose token did not come before (so generation stops
    there and not earlier); with `eos_list`, `[an id never generated, that id]`."""
    toks = free.tokens[0]
    k = next(
        (j for j in range(case.eos_step, len(toks) - 1) if toks[j] not in toks[:j]),
        None,
    )
    assert k is not None, f"{case.id}: no step from {case.eos_step} on gives a new token: {toks}"
    eos = toks[k]
    if not case.eos_list:
        return eos
    seen = {t for ts in free.tokens for t in ts} | {t for p in PROMPTS for t in p}
    unused = next(t for t in range(BASE[case.family]["vocab_size"] - 1, 0, -1) if t not in seen)
    return [unused, eos]


def check_exact(case: Case, plan_name: str, built, work: Path) -> None:
    cfg = ALL_PLANS[plan_name]
    plan_file, p = plan(built.dir, cfg, work, new_tokens=case.new_tokens, flags=case.plan_flags)
    assert p.rc == 0, f"{case.id}: meshplan plan {cfg}: {p.describe()}"
    problems = compare_steps(plan_file, built.dir, built.ref, case.new_tokens)
    if problems and case.contrast is not None:
        # Say whether meshplan computes what ignoring the field computes.
        r = run(plan_file, built.dir, 1)
        if r.rc == 0:
            other = generate(case.contrast(built.dir), 1)
            d = max_diff(json.loads(r.stdout)["logits"], other.logits[0][0])
            problems.append(
                f"step 0 logits against transformers with the field ignored (the case's contrast): "
                f"max abs diff {d:.3e}" + (" -- meshplan ignores the field" if d <= TOL else "")
            )
    assert not problems, (
        f"{case.id} on {cfg}: meshplan differs from transformers "
        f"(reference tokens {built.ref.tokens}):\n" + "\n".join(problems)
    )


def check_refused(case: Case, built, work: Path) -> None:
    """meshplan plan or run exits 2 naming the field; accepting it is a failure,
    reported with how far its output is from transformers'."""
    assert isinstance(case.expect, Refuse)
    name = case.expect.field
    plan_file, p = plan(built.dir, PLANS["single"], work, new_tokens=case.new_tokens)
    stage = "plan"
    if p.rc == 0:
        stage = "run"
        p = run(plan_file, built.dir, case.new_tokens)
    if p.rc == 0:
        v = json.loads(p.stdout)
        got = [r["tokens"] for r in v["requests"]]
        d = max_diff(v["logits"], built.ref.logits[0][-1])
        raise AssertionError(
            f"{case.id}: meshplan accepted a checkpoint it should refuse naming `{name}` "
            f"(exit 2); its tokens {got} vs transformers {built.ref.tokens}, "
            f"last-step logits differ by {d:.3e}"
        )
    assert p.rc == 2 and name in p.stderr, (
        f"{case.id}: expected exit 2 naming `{name}`; meshplan {stage}: {p.describe()}"
    )


def check_sensitive(case: Case, built) -> None:
    """The case can catch what it is for: transformers' own output moves when the
    field is ignored (the contrast) by more than SENSITIVITY."""
    if built.free is not None:
        other = built.free
    else:
        assert case.contrast is not None, case.id
        other = generate(case.contrast(built.dir), case.new_tokens)
    if other.tokens != built.ref.tokens:
        return
    d = max(max_diff(a, b) for a, b in zip(other.logits[0], built.ref.logits[0]))
    assert d > SENSITIVITY, (
        f"{case.id}: ignoring the field moves transformers' logits by only {d:.2e}: "
        f"the case would not catch it"
    )


# === contrasts ===


def reload_with(**config):
    """The checkpoint loaded with config fields replaced."""

    def f(dir: Path):
        return load(dir, **config)

    return f


def zeroed(*substrings):
    """The checkpoint with every parameter whose name holds one of `substrings`
    set to zero (a bias that is read but not applied)."""

    def f(dir: Path):
        m = load(dir)
        hit = 0
        with torch.no_grad():
            for n, p in m.named_parameters():
                if any(s in n for s in substrings):
                    p.zero_()
                    hit += 1
        assert hit, substrings
        return m

    return f


def tests(cases):
    """The tests of a table of cases, for a test module to bind with
    `globals().update(hfcheck.tests(CASES))`: `test_exact` (every exact case on each of its plans), `test_refused` (every
    Refuse case) and `test_sensitive` (every case with a contrast or an EOS)."""
    import pytest

    ids = [c.id for c in cases]
    assert len(set(ids)) == len(ids), ids
    exact = [pytest.param(c, p, id=f"{c.id}-{p}") for c in cases if c.expect == "exact" for p in c.plans]
    refused = [pytest.param(c, id=c.id) for c in cases if isinstance(c.expect, Refuse)]
    sensitive = [
        pytest.param(c, id=c.id) for c in cases if c.contrast is not None or c.eos_step is not None
    ]

    @pytest.mark.parametrize("case,plan_name", exact)
    def test_exact(case, plan_name, built, tmp_path):
        check_exact(case, plan_name, built(case), tmp_path / plan_name)

    @pytest.mark.parametrize("case", refused)
    def test_refused(case, built, tmp_path):
        check_refused(case, built(case), tmp_path / "refused")

    @pytest.mark.parametrize("case", sensitive)
    def test_sensitive(case, built):
        check_sensitive(case, built(case))

    out = {"test_exact": test_exact} if exact else {}
    if refused:
        out["test_refused"] = test_refused
    if sensitive:
        out["test_sensitive"] = test_sensitive
    return out
