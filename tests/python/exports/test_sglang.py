"""SGLang: the exported flags through sglang.srt.server_args.prepare_server_args
(argparse: unknown flags and bad values fail) and ServerArgs.resolve_once, the
resolution pipeline a launch runs (on --device cpu, offline, on a config.json made
from the plan's model); then SGLang's own derivation of the parallel widths
(runtime_context.parallel_widths_of: attention TP, MoE TP = tp / ep / moe_dp).
A serving deployment's export (every server of every pool, and the router) goes
through the same resolution, and its router line through sglang_router's parser."""

import argparse
import re
from importlib.metadata import version

import pytest

from sglang.srt.arg_groups.overrides import resolved_view
from sglang.srt.runtime_context import parallel_widths_of
from sglang.srt.server_args import prepare_server_args

from conftest import DEPLOYS, PLANS, arg_words, commands, comments, hf_config, longest_request, pool_of, strategy

SERVE = [n for n, (m, _, f) in PLANS.items() if "inference" in m or "@inference" in f]
ADDR = "192.0.2.1:5000"  # what a user puts in $SGLANG_DIST_INIT_ADDR


def test_version():
    assert version("sglang") == "0.5.23"


def launches(text):
    """The argument lists of one server's launch: one per node."""
    words = arg_words(text)
    per_node = [c for c in comments(text) if re.match(r"node \d+: ", c)]
    if not per_node:
        return [words]
    out = []
    for line in per_node:
        extra = line.split("THIS_FILE)", 1)[1].replace("$SGLANG_DIST_INIT_ADDR", ADDR).split()
        out.append(words + extra)
    return out


def resolve(words, model_dir):
    a = prepare_server_args(["--model-path", str(model_dir), "--skip-tokenizer-init", "--device", "cpu", *words])
    a.resolve_once()
    return resolved_view(a)


def test_every_expressible_plan_resolves(exports, tmp_path):
    done = exports.expressed("sglang", SERVE)
    assert {"llama3-70b-serve", "llama3-70b-dp-attention", "llama3-70b-serve-dp", "llama3-70b-2nodes",
            "mixtral-serve", "mixtral-serve-ep8", "mixtral-serve-ep-in-tp"} <= {n for n, _, _ in done}
    for name, text, plan in done:
        s = strategy(plan)
        model = hf_config(plan, tmp_path / name)
        copies = [int(m.group(1)) for c in comments(text) if (m := re.match(r"run (\d+) copies", c))]
        servers = copies[0] if copies else 1
        runs = launches(text)
        for rank, words in enumerate(runs):
            v = resolve(words, model)
            w = parallel_widths_of(v)
            # The widths SGLang derives are the plan's.
            assert w["moe_tp_size"] >= 1 and w["moe_tp_size"] * w["moe_ep_size"] * v.moe_dp_size == v.tp_size, name
            assert w["attn_tp_size"] == (1 if s.get("dp_attention") else s["tp"]), name
            assert w["moe_ep_size"] == s["ep"], name
            if s["ep"] > 1:
                assert w["moe_tp_size"] == 1, f"{name}: experts are whole on a rank in the plan"
            gpus = servers * v.tp_size * v.pp_size * v.dp_size
            assert gpus == s["tp"] * s["dp"] * s["pp"], name
            # --max-running-requests: per --dp-size replica, and per server split
            # over its attention groups; the plan's concurrency fits, with less than
            # one request per attention group to spare.
            groups = servers * v.dp_size * w["attn_dp_size"]
            per_group = v.max_running_requests // w["attn_dp_size"]
            concurrency = plan["workload"]["concurrency"]
            assert per_group * groups >= concurrency > (per_group - 1) * groups, name
            if len(runs) > 1:
                assert (v.nnodes, v.node_rank, v.dist_init_addr) == (len(runs), rank, ADDR), name
                assert v.tp_size * v.pp_size == len(runs) * plan["cluster"]["gpus_per_node"], name


def test_ep_over_replicas_is_one_wider_server(exports):
    text = exports.export("mixtral-serve-ep8", "sglang")
    assert "--tp-size 8" in text and "--ep-size 8" in text and "--attn-dp-size 2" in text, text


def test_unknown_flag_fails(tmp_path):
    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", str(tmp_path), "--tensor-model-parallel-size", "2"])


def parse_router(words):
    """sglang_router.launch_router's parser (launch_router.parse_router_args without
    the launcher's own imports)."""
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return RouterArgs.from_cli_args(parser.parse_args(words), use_router_prefix=False)


def server_words(words, model_dir):
    """A launch_server command's arguments, MODEL replaced by the model's directory."""
    assert words[:3] == ["python", "-m", "sglang.launch_server"], words
    return [str(model_dir) if w == "MODEL" else w for w in words[3:]]


def test_router_version():
    assert version("sglang-router") == "0.3.2"


def test_every_server_of_every_pool_resolves(exports, tmp_path):
    """Each pool's servers, resolved by SGLang: the pool's widths, its role, its
    requests in flight and prefill chunk; every instance started once, on GPUs and
    ports of its own; the router pairs every prefill server with every decode
    server (or balances the aggregated ones)."""
    modes = set()
    for name in DEPLOYS:
        text = exports.export(name, "sglang")
        assert text is not None, f"{name}: refused"
        _, plan = exports.plan(name)
        model = hf_config(plan, tmp_path / name)
        s = plan["serving"]
        modes.add(s["mode"])
        started = {"prefill": 0, "decode": 0}
        capacity = {"prefill": 0, "decode": 0}
        used = set()
        servers = {"prefill": [], "decode": []}
        router = None
        for above, env, words in commands(text):
            assert not env, words
            if words[2] == "sglang_router.launch_router":
                assert router is None, text
                router = parse_router(words[3:])
                continue
            a = prepare_server_args([*server_words(words, model), "--skip-tokenizer-init", "--device", "cpu"])
            given = (a.chunked_prefill_size, a.max_running_requests)
            a.resolve_once()
            v = resolved_view(a)
            w = parallel_widths_of(v)
            role = "prefill" if v.disaggregation_mode == "prefill" else "decode"
            assert v.disaggregation_mode == ("null" if s["mode"] == "aggregated" else role), name
            pool = pool_of(plan, role)
            c = pool["strategy"]
            # The pool's widths, as for a plan of its strategy.
            assert w["attn_tp_size"] == (1 if c.get("dp_attention") else c["tp"]), (name, words)
            assert w["moe_ep_size"] == c["ep"], (name, words)
            assert v.pp_size == c["pp"], (name, words)
            assert v.dcp_size == pool.get("dcp", 1), (name, words)
            if c["ep"] <= c["tp"]:
                assert v.tp_size == c["tp"], (name, words)
            # The deployment's knobs: the prefill chunk (none on decode servers) and
            # the requests in flight, per --dp-size replica and per instance.
            chunk = pool["chunked_prefill"] if role == "prefill" or s["mode"] == "aggregated" else None
            assert given[0] == chunk, (name, words)
            if chunk is not None:
                # SGLang splits a server's chunk over its data-parallel attention groups.
                groups = v.attn_dp_size or 1
                assert v.chunked_prefill_size == chunk // groups, (name, words)
            assert given[1] == v.max_running_requests, (name, words)
            if pool["gpus_per_instance"] == v.tp_size * v.pp_size or v.dp_size > 1:
                assert v.max_running_requests == pool["concurrency"], (name, words)
            assert v.context_length == longest_request(plan), (name, words)
            if s["mode"] == "disaggregated":
                assert v.disaggregation_transfer_backend == (
                    "nixl" if s["kv_transfer"]["link"] == "nvlink" else "mooncake"), (name, words)
            if v.node_rank > 0:
                continue
            # Every instance once: a server is --dp-size instances, or a whole
            # instance, or (experts over several replicas) a share of one.
            gpus = v.tp_size * v.pp_size * v.dp_size
            started[role] += gpus
            capacity[role] += v.max_running_requests * v.dp_size
            node = re.match(r"node (\d+), ", above).group(1)
            assert (node, v.port) not in used, (name, words)
            used.add((node, v.port))
            if v.nnodes == 1:
                for g in range(v.base_gpu_id, v.base_gpu_id + gpus):
                    assert (node, "gpu", g) not in used, (name, words)
                    used.add((node, "gpu", g))
            servers[role].append((f"http://NODE{node}:{v.port}", v.disaggregation_bootstrap_port))
        for role in ("prefill", "decode") if s["mode"] == "disaggregated" else ("decode",):
            pool = pool_of(plan, role)
            assert started[role] == pool["instances"] * pool["gpus_per_instance"], (name, role)
            requests = pool["instances"] * pool["concurrency"]
            assert capacity[role] >= requests, (name, role)
        if s["mode"] == "disaggregated":
            assert router is not None and router.pd_disaggregation, text
            assert router.prefill_urls == servers["prefill"], text
            assert router.decode_urls == [u for u, _ in servers["decode"]], text
        elif len(servers["decode"]) > 1:
            assert router.worker_urls == [u for u, _ in servers["decode"]], text
        else:
            assert router is None, text
        if router is not None:
            assert (router.host, router.port) == ("0.0.0.0", 8000), text
    assert modes == {"aggregated", "disaggregated"}
