"""DeepSpeed: the exported JSON through deepspeed.runtime.config.DeepSpeedConfig
(its pydantic sections forbid unknown keys; batch arithmetic checked)."""

import json

import deepspeed
import deepspeed.runtime.config as dsc
import deepspeed.runtime.constants as consts
import pytest

from conftest import PLANS, strategy

TRAIN = [n for n, (m, _, _) in PLANS.items() if "inference" not in m and "serve" not in n]


class DataParallel:
    """The one thing DeepSpeedConfig asks a model-parallel unit: the data-parallel size."""

    def __init__(self, dp):
        self.dp = dp

    def get_data_parallel_world_size(self):
        return self.dp


def config(cfg, dp, monkeypatch):
    # DeepSpeedConfig reads the rank from deepspeed.comm, which needs a launched job.
    monkeypatch.setattr(dsc.dist, "get_rank", lambda *a, **k: 0)
    return dsc.DeepSpeedConfig(cfg, mpu=DataParallel(dp))


def known_top_level_keys():
    keys = {v for k, v in vars(consts).items() if k.isupper() and isinstance(v, str)}
    return keys | {"zero_optimization", "activation_checkpointing", "bf16", "fp16"}


def test_version():
    assert deepspeed.__version__ == "0.19.8"


def test_every_expressible_plan_is_accepted(exports, monkeypatch):
    done = exports.expressed("deepspeed", TRAIN)
    assert {"llama3-8b-fsdp", "llama3-8b-zero2", "llama3-8b-zero1"} <= {n for n, _, _ in done}
    for name, text, plan in done:
        s = strategy(plan)
        cfg = json.loads(text)
        unknown = set(cfg) - known_top_level_keys()
        assert not unknown, f"{name}: DeepSpeed defines no {unknown}"
        c = config(cfg, s["dp"], monkeypatch)
        assert c.train_batch_size == plan["workload"]["global_batch"], name
        assert c.train_micro_batch_size_per_gpu == s["mbs"], name
        assert c.gradient_accumulation_steps * s["mbs"] * s["dp"] == c.train_batch_size, name
        assert c.zero_optimization_stage == s["zero"], name
        assert c.bfloat16_config.enabled == (plan["model"]["dtype"] == "bf16"), name


def test_unknown_or_wrong_values_fail(exports, monkeypatch):
    text = exports.export("llama3-8b-fsdp", "deepspeed")
    cfg = json.loads(text)
    with pytest.raises(Exception):
        config({**cfg, "zero_optimization": {"stage": 3, "bogus": 1}}, 8, monkeypatch)
    with pytest.raises(AssertionError):
        config(cfg, 7, monkeypatch)  # train_batch_size != micro x accumulation x dp
