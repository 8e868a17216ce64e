"""Plans made and exported by the built meshplan binary, shared by the tests.

Each framework's test feeds these exports to the framework's own configuration
code (parsers, validators, mesh builders) at the pinned version; see run.sh.
"""

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(os.environ.get("MESHPLAN_BIN", ROOT / "target" / "release" / "meshplan"))

INFERENCE_WORKLOAD = Path(__file__).resolve().parent / "inference-workload.yaml"
DISAGGREGATED_WORKLOAD = Path(__file__).resolve().parent / "disaggregated-workload.yaml"

# name: (model, cluster, plan flags). Training plans first, then serving plans.
PLANS = {
    # dense tp/pp/dp on 384 nodes, ZeRO-1 (Megatron's GPT-3 layout)
    "gpt3-3d": ("models/gpt3-175b.yaml", "topologies/dgx-a100-80g.yaml",
                ["--nodes", "384", "--config",
                 "dp=48,tp=8,pp=8,cp=1,mbs=1,recompute=full,zero=1,sp=false,vpp=1"]),
    # interleaved virtual stages, sequence parallelism, selective recomputation
    "gpt3-interleaved": ("models/gpt3-175b.yaml", "topologies/dgx-a100-80g.yaml",
                         ["--nodes", "384", "--config",
                          "dp=48,tp=8,pp=8,cp=1,mbs=1,recompute=selective,zero=1,sp=true,vpp=2"]),
    # FSDP (ZeRO-3) and ZeRO-2 on one node
    "llama3-8b-fsdp": ("models/llama3-8b.yaml", "topologies/dgx-h100.yaml",
                       ["--config", "dp=8,tp=1,pp=1,cp=1,mbs=1,zero=3,recompute=full"]),
    "llama3-8b-zero2": ("models/llama3-8b.yaml", "topologies/dgx-h100.yaml",
                        ["--config", "dp=8,tp=1,pp=1,cp=1,mbs=2,zero=2,recompute=full"]),
    # plain data parallelism with ZeRO-1 (DeepSpeed stage 1, Megatron's distributed
    # optimizer), planned for DeepSpeed
    "llama3-8b-zero1": ("models/llama3-8b.yaml", "topologies/dgx-h100.yaml",
                        ["--framework", "deepspeed", "--nodes", "2", "--config",
                         "dp=16,tp=1,pp=1,cp=1,mbs=1,zero=1,recompute=full"]),
    # context parallelism with tensor parallelism, and with FSDP
    "llama3-8b-cp": ("models/llama3-8b.yaml", "topologies/dgx-h100.yaml",
                     ["--config", "dp=2,tp=2,pp=1,cp=2,mbs=1,zero=1,sp=true,recompute=selective"]),
    "llama3-8b-cp-fsdp": ("models/llama3-8b.yaml", "topologies/dgx-h100.yaml",
                          ["--config", "dp=2,tp=2,pp=1,cp=2,mbs=1,zero=3,sp=true,recompute=none"]),
    # 3D with FSDP on 64 GPUs
    "llama3-70b-3d": ("models/llama3-70b.yaml", "topologies/dgx-h100.yaml",
                      ["--nodes", "8", "--config",
                       "dp=4,tp=8,pp=2,cp=1,mbs=1,zero=3,sp=true,recompute=selective,vpp=1"]),
    # experts over 8 ranks, planned for Megatron-LM
    "mixtral-ep": ("models/mixtral-8x7b.yaml", "topologies/dgx-h100.yaml",
                   ["--framework", "megatron-core", "--nodes", "4", "--config",
                    "dp=16,tp=2,pp=1,cp=1,ep=8,mbs=1,zero=1,sp=true,recompute=selective"]),
    "mixtral-ep-fsdp": ("models/mixtral-8x7b.yaml", "topologies/dgx-h100.yaml",
                        ["--nodes", "4", "--config",
                         "dp=16,tp=2,pp=1,cp=1,ep=8,mbs=1,zero=3,sp=true,recompute=full"]),
    # serving
    "llama3-70b-serve": ("models/llama3-70b-inference.yaml", "topologies/h200-node.yaml",
                         ["--config", "tp=8,pp=1"]),
    "llama3-70b-dp-attention": ("models/llama3-70b-inference.yaml", "topologies/h200-node.yaml",
                                ["--config", "tp=8,pp=1,dp_attention=true"]),
    "llama3-70b-serve-dp": ("models/llama3-70b-inference.yaml", "topologies/h200-node.yaml",
                            ["--config", "tp=4,pp=1,dp=2,dp_attention=false"]),
    # one server over two nodes
    "llama3-70b-2nodes": ("models/llama3-70b-inference.yaml", "topologies/h200-node.yaml",
                          ["--nodes", "2", "--config", "tp=16,pp=1,dp=1,dp_attention=false"]),
    # two nodes of data-parallel replicas
    "llama3-70b-2nodes-dp": ("models/llama3-70b-inference.yaml", "topologies/h200-node.yaml",
                             ["--nodes", "2", "--config", "tp=8,pp=1,dp=2,dp_attention=false"]),
    # Mixtral served: the planner's own choice, and ep over two tp=4 replicas
    "mixtral-serve": ("models/mixtral-8x7b.yaml", "topologies/h200-node.yaml",
                      ["--workload", "@inference"]),
    "mixtral-serve-ep8": ("models/mixtral-8x7b.yaml", "topologies/h200-node.yaml",
                          ["--workload", "@inference", "--config", "tp=4,dp=2,ep=8,dp_attention=false"]),
    "mixtral-serve-ep-in-tp": ("models/mixtral-8x7b.yaml", "topologies/h200-node.yaml",
                               ["--workload", "@inference", "--config", "tp=8,dp=1,ep=8,dp_attention=false"]),
}

# Serving deployments (`meshplan deploy`, plans with a `serving` section): name:
# (model, cluster, deploy flags). Their exports launch every server of each pool.
DEPLOYS = {
    # Llama 3 70B on one H200 node: aggregated wins (instances of tp=2 with chunked prefill)
    "llama3-70b-deploy": ("models/llama3-70b-inference.yaml", "topologies/h200-node.yaml", []),
    # the same searched as prefill and decode pools only
    "llama3-70b-deploy-pd": ("models/llama3-70b-inference.yaml", "topologies/h200-node.yaml",
                             ["--workload", "@disaggregated"]),
    # pools of tp=4 servers over four nodes: several servers per pool and node
    "llama3-70b-deploy-pd-4nodes": ("models/llama3-70b-inference.yaml", "topologies/h200-node.yaml",
                                    ["--nodes", "4", "--config", "tp=4", "--workload", "@disaggregated"]),
    # Mixtral's pools: DP-attention and experts inside the decode instances (SGLang)
    "mixtral-deploy-pd": ("models/mixtral-8x7b.yaml", "topologies/h200-node.yaml",
                          ["--workload", "@disaggregated"]),
    # DeepSeek-V3's latent cache split over 4 tensor ranks of each decode instance
    "deepseek-v3-deploy-dcp": ("models/deepseek-v3.yaml", "topologies/h200-node.yaml",
                               ["--nodes", "2", "--workload", "@inference", "--dcp", "4",
                                "--decode-config", "dp_attention=false"]),
}


def _flags(flags):
    special = {"@inference": str(INFERENCE_WORKLOAD), "@disaggregated": str(DISAGGREGATED_WORKLOAD)}
    return [special.get(f, f) for f in flags]


def _run(args, **kw):
    return subprocess.run([str(BIN), *args], cwd=ROOT, capture_output=True, text=True, **kw)


class Exports:
    """Plans and their exports, made once per session."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.plans = {}
        self.texts = {}
        assert BIN.exists(), f"{BIN}: build meshplan first (cargo build --release) or set MESHPLAN_BIN"

    def plan(self, name):
        """The plan file's path and its JSON."""
        if name not in self.plans:
            command = "deploy" if name in DEPLOYS else "plan"
            model, cluster, flags = DEPLOYS[name] if name in DEPLOYS else PLANS[name]
            path = self.tmp / f"{name}.json"
            r = _run(["-q", command, model, cluster, *_flags(flags), "-o", str(path)])
            assert r.returncode == 0, f"{command} {name}: {r.stderr}"
            self.plans[name] = (path, json.loads(path.read_text()))
        return self.plans[name]

    def export(self, name, target):
        """The export's text, or None when meshplan refuses (exit 3)."""
        key = (name, target)
        if key not in self.texts:
            path, _ = self.plan(name)
            r = _run(["export", str(path), "--to", target])
            if r.returncode == 3:
                assert r.stderr.startswith(f"error: cannot export this plan to {target}: "), r.stderr
                self.texts[key] = None
            else:
                assert r.returncode == 0, f"export {name} --to {target}: {r.stderr}"
                self.texts[key] = r.stdout
        return self.texts[key]

    def expressed(self, target, names=None):
        """(name, text, plan) of every plan the target expresses."""
        out = []
        for name in names or PLANS:
            text = self.export(name, target)
            if text is not None:
                out.append((name, text, self.plan(name)[1]))
        return out


@pytest.fixture(scope="session")
def exports(tmp_path_factory):
    return Exports(tmp_path_factory.mktemp("plans"))


def arg_words(text):
    """The argument words of an exported argument list (comments dropped), as
    `$(grep -v '^#' FILE)` gives them to the shell."""
    words = []
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        words.extend(line.split())
    return words


def commands(text):
    """The commands of a deployment's export: (comment above, environment, words),
    split as the shell splits them."""
    out = []
    above = ""
    for line in text.splitlines():
        if line.startswith("# "):
            above = line[2:]
            continue
        words = shlex.split(line)
        env = {}
        while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
            k, v = words.pop(0).split("=", 1)
            env[k] = v
        out.append((above, env, words))
    return out


def pool_of(plan, role):
    """The `serving` pool a server of `role` belongs to: prefill, or the pool that
    decodes (the whole deployment when aggregated)."""
    s = plan["serving"]
    return s["prefill"] if role == "prefill" else s["decode"]


def longest_request(plan):
    """The longest request the deployment's workload allows (the plan's lengths are
    the distributions' means; these plans have none)."""
    w = plan["workload"]
    return w["prompt_len"] + w["output_len"]


def comments(text):
    return [l[2:] for l in text.splitlines() if l.startswith("# ")]


def strategy(plan):
    return plan["strategy"]


def world(plan):
    return plan["cluster"]["nodes"] * plan["cluster"]["gpus_per_node"]


def hf_config(plan, directory: Path):
    """A Hugging Face config.json (no weights) for the plan's model, so serving
    frameworks can resolve the model's shape offline."""
    t = plan["model"]["transformer"]
    cfg = {
        "hidden_size": t["hidden"],
        "intermediate_size": t["ffn_hidden"],
        "num_hidden_layers": t["layers"],
        "num_attention_heads": t["heads"],
        "num_key_value_heads": t["kv_heads"],
        "head_dim": t["head_dim"],
        "vocab_size": t["vocab"],
        "max_position_embeddings": max(t.get("max_positions", 8192), 8192),
        "rms_norm_eps": t["norm_eps"],
        "rope_theta": t["rope_theta"],
        "tie_word_embeddings": t["tie_embeddings"],
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if t.get("mla"):
        m, moe = t["mla"], t["moe"]
        cfg.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                   q_lora_rank=m["q_lora_rank"], kv_lora_rank=m["kv_lora_rank"],
                   qk_rope_head_dim=m["qk_rope_head_dim"], v_head_dim=m["v_head_dim"],
                   qk_nope_head_dim=t["head_dim"] - m["qk_rope_head_dim"],
                   n_routed_experts=moe["experts"], num_experts_per_tok=moe["top_k"],
                   moe_intermediate_size=moe["expert_ffn_hidden"],
                   n_shared_experts=moe.get("shared_experts", 0),
                   first_k_dense_replace=moe.get("first_dense_layers", 0),
                   n_group=8, topk_group=4, routed_scaling_factor=2.5,
                   norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid")
    elif t.get("moe"):
        cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                   num_local_experts=t["moe"]["experts"],
                   num_experts_per_tok=t["moe"]["top_k"],
                   intermediate_size=t["moe"]["expert_ffn_hidden"])
    else:
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return directory
