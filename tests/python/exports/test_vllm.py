"""vLLM: the exported flags through vLLM's own serve parser (make_arg_parser:
unknown flags and bad values fail), EngineArgs and create_engine_config (model,
parallel and scheduler configs validated offline on a config.json made from the
plan's model; vLLM's CPU platform stands in for the GPU, its own device
adjustments skipped). A serving deployment's export: every server of every pool
through the same configuration, its router line through vllm-router's parser."""

import argparse
import os
from importlib.metadata import version

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.entrypoints.common.cli_args import make_arg_parser  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

from conftest import DEPLOYS, PLANS, arg_words, commands, hf_config, longest_request, pool_of, strategy  # noqa: E402

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


def parse_router(words):
    """vllm-router's parser (launch_router.parse_router_args without the
    launcher's own imports)."""
    from vllm_router.router_args import RouterArgs

    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return RouterArgs.from_cli_args(parser.parse_args(words), use_router_prefix=False)


def test_router_version():
    assert version("vllm-router") == "0.1.17"


def test_every_server_of_every_pool_configures(exports, tmp_path, monkeypatch):
    """Each pool's `vllm serve`, configured by vLLM: the pool's widths, its
    requests in flight and prefill chunk, the NIXL connector between pools; every
    instance started once on GPUs of its own; the router pairs the pools."""
    modes = set()
    for name in DEPLOYS:
        text = exports.export(name, "vllm")
        _, plan = exports.plan(name)
        s = plan["serving"]
        if text is None:
            # vLLM runs attention data-parallel only across engines.
            assert any(p and p["strategy"].get("dp_attention") for p in (s["decode"], s.get("prefill"))), name
            continue
        model = hf_config(plan, tmp_path / name)
        modes.add(s["mode"])
        started = {"prefill": 0, "decode": 0}
        urls = {"prefill": [], "decode": []}
        side_channels = set()
        gpus_used = set()
        router = None
        for above, env, words in commands(text):
            if words[0] == "vllm-router":
                assert router is None, text
                router = parse_router(words[1:])
                continue
            assert words[:3] == ["vllm", "serve", "MODEL"], words
            role = "prefill" if "prefill server" in above else "decode"
            pool = pool_of(plan, role)
            c = engine_config(words[3:], model, monkeypatch)
            p = c.parallel_config
            st = pool["strategy"]
            assert (p.tensor_parallel_size, p.pipeline_parallel_size) == (st["tp"], st["pp"]), (name, words)
            assert p.enable_expert_parallel == (st["ep"] > 1), (name, words)
            assert p.decode_context_parallel_size == pool.get("dcp", 1), (name, words)
            # Requests in flight per engine: an instance's share, over its own
            # data-parallel ranks.
            assert c.scheduler_config.max_num_seqs * st["dp"] >= pool["concurrency"], (name, words)
            assert (c.scheduler_config.max_num_seqs - 1) * st["dp"] < pool["concurrency"], (name, words)
            chunk = pool["chunked_prefill"] if role == "prefill" or s["mode"] == "aggregated" else None
            if chunk is not None:
                assert c.scheduler_config.max_num_batched_tokens == chunk, (name, words)
                assert c.scheduler_config.enable_chunked_prefill, (name, words)
            else:
                assert "--max-num-batched-tokens" not in words, (name, words)
            assert c.model_config.max_model_len == longest_request(plan), (name, words)
            kv = c.kv_transfer_config
            if s["mode"] == "disaggregated":
                assert (kv.kv_connector, kv.kv_role) == ("NixlConnector", "kv_both"), (name, words)
                host, port = env["VLLM_NIXL_SIDE_CHANNEL_HOST"], int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
                for rank in range(p.data_parallel_size):
                    assert (host, port + rank) not in side_channels, (name, words)
                    side_channels.add((host, port + rank))
            else:
                assert kv is None, (name, words)
            node = above.split(",")[0]
            if "CUDA_VISIBLE_DEVICES" in env:
                ids = [int(g) for g in env["CUDA_VISIBLE_DEVICES"].split(",")]
                assert len(ids) == p.world_size_across_dp, (name, words)
                for g in ids:
                    assert (node, g) not in gpus_used, (name, words)
                    gpus_used.add((node, g))
            started[role] += p.data_parallel_size // st["dp"]
            urls[role].append(f"http://NODE{node.removeprefix('node ')}:{words[words.index('--port') + 1]}")
        for role in ("prefill", "decode") if s["mode"] == "disaggregated" else ("decode",):
            assert started[role] == pool_of(plan, role)["instances"], (name, role)
        if s["mode"] == "disaggregated":
            assert router.vllm_pd_disaggregation and router.kv_connector == "nixl", text
            assert [u for u, _ in router.prefill_urls] == urls["prefill"], text
            assert router.decode_urls == urls["decode"], text
        elif len(urls["decode"]) > 1:
            assert router.worker_urls == urls["decode"], text
        else:
            assert router is None, text
    assert modes == {"aggregated", "disaggregated"}
