"""SGLang: the exported flags through sglang.srt.server_args.prepare_server_args
(argparse: unknown flags and bad values fail) and ServerArgs.resolve_once, the
resolution pipeline a launch runs (on --device cpu, offline, on a config.json made
from the plan's model); then SGLang's own derivation of the parallel widths
(runtime_context.parallel_widths_of: attention TP, MoE TP = tp / ep / moe_dp)."""

import re
from importlib.metadata import version

import pytest

from sglang.srt.arg_groups.overrides import resolved_view
from sglang.srt.runtime_context import parallel_widths_of
from sglang.srt.server_args import prepare_server_args

from conftest import PLANS, arg_words, comments, hf_config, strategy

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
