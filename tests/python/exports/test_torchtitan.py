"""torchtitan: the command-line export (--to torchtitan-cli) through torchtitan
0.3's ConfigManager and ParallelDims (its device mesh built on a fake process
group), and the TOML export (--to torchtitan) through torchtitan 0.2.2's
ConfigManager and ParallelDims, the last release that reads TOML."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import torchtitan
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims

from conftest import PLANS, arg_words, strategy, world

HERE = Path(__file__).resolve().parent
TRAIN = [n for n, (m, _, _) in PLANS.items() if "inference" not in m and "serve" not in n]
# torchtitan 0.3 config functions to override (the parallelism and batch keys the
# export sets do not depend on the model's own shape).
CONFIGS = {
    "llama3-8b": ("llama3", "llama3_8b"),
    "llama3-70b": ("llama3", "llama3_70b"),
    "mixtral-8x7b": ("qwen3", "qwen3_30b_a3b"),
}
EXPECTED = {"llama3-8b-fsdp", "llama3-8b-zero2", "llama3-8b-cp-fsdp", "llama3-70b-3d", "mixtral-ep-fsdp"}


def test_version():
    from importlib.metadata import version

    assert version("torchtitan") == "0.3.0"


def build_mesh(parallelism, world_size):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        dims = ParallelDims.from_config(parallelism, world_size)
        mesh = dims.build_mesh()
        return dims, mesh
    finally:
        dist.destroy_process_group()


def test_cli_export_through_torchtitan_0_3(exports):
    done = exports.expressed("torchtitan-cli", TRAIN)
    assert EXPECTED <= {n for n, _, _ in done}
    for name, text, plan in done:
        module, fn = CONFIGS[plan["model"]["name"]]
        s = strategy(plan)
        # tyro: an unknown flag, a bad value or a bad subcommand exits 2.
        cfg = ConfigManager().parse_args(["--module", module, "--config", fn, *arg_words(text)])
        p, t = cfg.parallelism, cfg.training
        assert p.tensor_parallel_degree == s["tp"], name
        assert p.pipeline_parallel_degree == s["pp"], name
        assert p.context_parallel_degree == s["cp"], name
        assert p.expert_parallel_degree == s["ep"], name
        assert p.data_parallel_replicate_degree * p.data_parallel_shard_degree == s["dp"], name
        assert t.global_batch_size == plan["workload"]["global_batch"], name
        ac = type(cfg.activation_checkpoint).__qualname__ if cfg.activation_checkpoint else "None"
        assert ac == {"none": "None", "full": "FullAC.Config", "selective": "SelectiveAC.Config"}[s["recompute"]], name
        # Beyond parsing: the device mesh torchtitan builds from it, and the
        # trainer's batch check (global batch = local batch x dp x accumulation).
        dims, _ = build_mesh(p, world(plan))
        assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp, dims.ep) == (
            p.data_parallel_replicate_degree, p.data_parallel_shard_degree, s["tp"], s["pp"], s["cp"], s["ep"]), name
        batch_degree = dims.dp_replicate * dims.dp_shard
        assert t.global_batch_size % (t.local_batch_size * batch_degree) == 0, name


def test_unknown_flag_fails_in_0_3():
    with pytest.raises(SystemExit):
        ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_8b", "--parallelism.tensor_model_parallel_size", "2"])


def test_toml_export_through_torchtitan_0_2_2(exports, tmp_path):
    """torchtitan 0.2.2 (installed apart, run in its own process): the TOML read by
    its ConfigManager (unknown keys raise) and its ParallelDims mesh."""
    done = exports.expressed("torchtitan", TRAIN)
    assert EXPECTED <= {n for n, _, _ in done}
    cases = []
    for name, text, plan in done:
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        cases.append({"name": name, "toml": str(path), "world": world(plan), "strategy": strategy(plan),
                      "global_batch": plan["workload"]["global_batch"]})
    # A misspelt key must fail there too.
    bad = tmp_path / "bad.toml"
    bad.write_text(done[0][1].replace("tensor_parallel_degree", "tensor_model_parallel_size"))
    cases.append({"name": "bad", "toml": str(bad), "expect_error": True})
    env = {**os.environ, "PYTHONPATH": os.environ["TORCHTITAN_022_DIR"]}
    r = subprocess.run([sys.executable, str(HERE / "torchtitan_0_2_2.py")], input=json.dumps(cases),
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"checked {len(cases)}" in r.stdout, r.stdout
