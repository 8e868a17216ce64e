"""Megatron-LM: the exported arguments through megatron-core's own parse_args and
validate_args (megatron.training.arguments, in the megatron-core wheel)."""

import os
import sys
import typing

import pytest
import typing_extensions

from conftest import PLANS, arg_words, comments, strategy, world

# The megatron-core 0.19.2 wheel is for Python 3.12 and later; its pure-Python
# sources are unpacked beside the venv by run.sh. typing.override is the only
# 3.12 name its argument code imports.
if not hasattr(typing, "override"):
    typing.override = typing_extensions.override
sys.path.insert(0, os.environ["MEGATRON_CORE_DIR"])

import megatron.training.arguments as margs  # noqa: E402
from megatron.core.package_info import __version__ as MCORE_VERSION  # noqa: E402

# What a launch adds besides the plan's arguments (data, tokenizer, optimizer).
EXTRA = ["--tokenizer-type", "NullTokenizer", "--mock-data", "--lr", "1e-4", "--train-iters", "10"]
TRAIN = [n for n, (m, _, _) in PLANS.items() if "inference" not in m and "serve" not in n]


def test_version():
    assert MCORE_VERSION == "0.19.2"


def validated(words, nodes_gpus, env, arch=9):
    """parse_args + validate_args of one rank, as pretrain_gpt.py runs them, on a
    GPU of compute capability `arch` (9: Hopper; the checks differ from 10 on)."""
    saved = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    os.environ.update(env)
    argv = sys.argv
    sys.argv = ["pretrain_gpt.py", *words, *EXTRA]
    margs.get_device_arch_version = lambda: arch
    try:
        args = margs.parse_args()  # argparse: an unknown flag or bad value exits 2
        args.rank, args.world_size = 0, nodes_gpus
        margs.validate_args(args)
        return args
    finally:
        sys.argv = argv
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        if saved is not None:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = saved


def launch_env(text):
    """The environment the export's launch line sets."""
    line = next(c for c in comments(text) if "torchrun" in c)
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if line.startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 ") else {}


def test_every_expressible_plan_validates(exports):
    done = exports.expressed("megatron", TRAIN)
    assert {"gpt3-3d", "gpt3-interleaved", "llama3-8b-fsdp", "llama3-8b-cp", "llama3-70b-3d",
            "mixtral-ep"} <= {n for n, _, _ in done}
    for name, text, plan in done:
        s = strategy(plan)
        args = validated(arg_words(text), world(plan), launch_env(text))
        # Beyond parsing: the layout Megatron derives is the plan's.
        assert args.tensor_model_parallel_size == s["tp"], name
        assert args.pipeline_model_parallel_size == s["pp"], name
        assert args.context_parallel_size == s["cp"], name
        assert args.data_parallel_size == s["dp"], name
        assert args.expert_model_parallel_size == s["ep"], name
        assert (args.virtual_pipeline_model_parallel_size or 1) == s["vpp"], name
        micro = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
        assert micro * args.micro_batch_size * args.data_parallel_size == args.global_batch_size
        assert args.sequence_parallel == (s["sp"] and s["tp"] > 1), name
        assert args.use_distributed_optimizer == (s["zero"] >= 1), name
        assert args.use_megatron_fsdp == (s["zero"] >= 2), name
        # The vocabulary is not padded beyond the plan's (Megatron pads to a
        # multiple of make_vocab_size_divisible_by x tp).
        t = plan["model"]["transformer"]
        mult = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
        assert t["vocab"] % mult == 0, name
        assert args.num_layers == t["layers"] and args.hidden_size == t["hidden"], name


def test_fsdp_needs_its_checkpoint_format_and_tp_its_env(exports):
    """The two launch conditions validate_args checks, shown to bite: the FSDP export
    without --ckpt-format, and a tensor-parallel export without the env."""
    text = exports.export("llama3-8b-fsdp", "megatron")
    words = arg_words(text)
    i = words.index("--ckpt-format")
    assert words[i + 1] == "fsdp_dtensor"
    with pytest.raises(AssertionError, match="fsdp_dtensor"):
        validated(words[:i] + words[i + 2:], 8, {})
    with pytest.raises(AssertionError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        validated(words, 8, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    text = exports.export("llama3-8b-cp", "megatron")
    assert launch_env(text)
    with pytest.raises(AssertionError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        validated(arg_words(text), 8, {})
    # Blackwell (compute capability 10) no longer needs it.
    validated(arg_words(text), 8, {}, arch=10)


def test_unknown_flag_fails():
    with pytest.raises(SystemExit):
        validated(["--tensor-parallel-size", "2"], 8, {})
