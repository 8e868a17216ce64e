"""vLLM: the exported flags through vLLM's own serve parser (make_arg_parser:
unknown flags and bad values fail), EngineArgs and create_engine_config (model,
parallel and scheduler configs validated offline on a config.json made from the
plan's model; vLLM's CPU platform stands in for the GPU, its own device
adjustments skipped)."""

import os
from importlib.metadata import version

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.entrypoints.common.cli_args import make_arg_parser  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

from conftest import PLANS, arg_words, hf_config, strategy  # noqa: E402

SERVE = [n for n, (m, _, f) in PLANS.items() if "inference" in m or "@inference" in f]


def test_version():
    assert version("vllm") == "0.34.0"


def engine_config(words, model_dir, monkeypatch):
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", str(model_dir), "--skip-tokenizer-init", *words])
    e = EngineArgs.from_cli_args(args)
    # x86 CPUs need triton-cpu for vLLM's CPU backend; the device settings are not
    # what is checked here.
    monkeypatch.setattr(type(current_platform), "check_and_update_config", classmethod(lambda cls, c: None))
    return e.create_engine_config()


def test_every_expressible_plan_configures(exports, tmp_path, monkeypatch):
    done = exports.expressed("vllm", SERVE)
    assert {"llama3-70b-serve", "llama3-70b-serve-dp", "llama3-70b-2nodes", "mixtral-serve-ep-in-tp"} <= {
        n for n, _, _ in done}
    for name, text, plan in done:
        s = strategy(plan)
        c = engine_config(arg_words(text), hf_config(plan, tmp_path / name), monkeypatch)
        p = c.parallel_config
        assert (p.tensor_parallel_size, p.pipeline_parallel_size, p.data_parallel_size) == (
            s["tp"], s["pp"], s["dp"]), name
        assert p.world_size_across_dp == s["tp"] * s["pp"] * s["dp"], name
        assert p.enable_expert_parallel == (s["ep"] > 1), name
        concurrency = plan["workload"]["concurrency"]
        assert c.scheduler_config.max_num_seqs * p.data_parallel_size >= concurrency, name
        w = plan["workload"]
        assert c.model_config.max_model_len == w["prompt_len"] + w["output_len"], name


def test_unknown_flag_fails(tmp_path):
    with pytest.raises(SystemExit):
        make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", str(tmp_path), "--tp-size", "2"])
