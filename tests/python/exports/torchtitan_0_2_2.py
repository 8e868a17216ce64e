"""Run by test_torchtitan.py with torchtitan 0.2.2 first on the path: reads the
cases (JSON on stdin), loads each TOML with that release's ConfigManager and
builds its ParallelDims mesh on a fake process group."""

import json
import sys
from importlib.metadata import version

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import torchtitan
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims

assert "0.2.2" in torchtitan.__file__ or version("torchtitan") == "0.2.2", torchtitan.__file__

checked = 0
for case in json.load(sys.stdin):
    try:
        cfg = ConfigManager().parse_args(["--job.config_file", case["toml"]])
    except (ValueError, SystemExit) as e:
        assert case.get("expect_error"), f"{case['name']}: {e}"
        checked += 1
        continue
    assert not case.get("expect_error"), f"{case['name']}: accepted"
    p, s = cfg.parallelism, case["strategy"]
    assert (p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree,
            p.expert_parallel_degree) == (s["tp"], s["pp"], s["cp"], s["ep"]), case["name"]
    assert p.data_parallel_replicate_degree * p.data_parallel_shard_degree == s["dp"], case["name"]
    assert cfg.training.global_batch_size == case["global_batch"], case["name"]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=case["world"])
    dims = ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                        ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree,
                        world_size=case["world"])
    dims.build_mesh()
    dist.destroy_process_group()
    checked += 1
print(f"checked {checked}")
