"""The installed `meshplan` package against the command line it wraps: the same
numbers, the same messages and exit-code classes, typed results, pandas and the
Jupyter display hooks."""

import json
import os
import subprocess
from pathlib import Path

import pytest

import meshplan

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(os.environ.get("MESHPLAN_BIN", ROOT / "target" / "release" / "meshplan"))
GPT3 = str(ROOT / "models" / "gpt3-175b.yaml")
A100 = str(ROOT / "topologies" / "dgx-a100-80g.yaml")
TINY = str(ROOT / "models" / "tiny-gpt.yaml")
CPU = str(ROOT / "topologies" / "cpu-test-mesh.yaml")


def cli(*args, code=0):
    p = subprocess.run([str(BIN), *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == code, f"meshplan {' '.join(map(str, args))}: exit {p.returncode}\n{p.stderr}"
    return p


def test_the_issue_example_prints_the_clis_number(tmp_path):
    p = meshplan.plan(GPT3, A100, nodes=480)
    out = cli("plan", GPT3, A100, "--nodes", 480, "-o", tmp_path / "cli.json", "--json")
    want = json.loads(out.stdout)
    assert p.step_time_s == want["predicted"]["step_time_s"]
    assert p.strategy == want["strategy"]
    assert isinstance(p.predicted, meshplan.Prediction)
    assert 0 < p.predicted.mfu < 1
    # The plan file is the command line's, byte for byte but the search's wall time.
    mine = json.loads(p.path.read_text())
    theirs = json.loads((tmp_path / "cli.json").read_text())
    mine["search"].pop("wall_s", None)
    theirs["search"].pop("wall_s", None)
    assert mine == theirs


def test_fixed_keys_framework_and_top():
    p = meshplan.plan(GPT3, A100, nodes=480, config={"tp": 8}, framework="megatron-core", top=3)
    assert p.strategy["tp"] == 8
    assert json.loads(p.path.read_text())["workload"]["framework"] == "megatron-core"
    assert "tp=8" in p.config
    assert len(p.top) == 3
    # A framework that cannot run the fixed keys: bad input, with the reason.
    with pytest.raises(meshplan.BadInput) as e:
        meshplan.plan(GPT3, A100, nodes=480, config={"tp": 8, "pp": 16}, framework="megatron-core")
    assert "megatron-core" in e.value.message


def test_estimate_equals_the_cli():
    cfg = "dp=60,tp=8,pp=8,mbs=1,recompute=full"
    e = meshplan.estimate(GPT3, A100, cfg, nodes=480)
    want = json.loads(cli("estimate", GPT3, A100, "--nodes", 480, "--config", cfg, "--json").stdout)
    assert e.step_time_s == want["step_time_s"]
    assert e.memory_per_gpu_bytes == want["memory_per_gpu_bytes"]
    # A dict is the same configuration.
    d = meshplan.estimate(GPT3, A100, {"dp": 60, "tp": 8, "pp": 8, "mbs": 1, "recompute": "full"}, nodes=480)
    assert d == e


def test_compare_rows_pandas_and_svg():
    c = meshplan.compare(
        GPT3, A100, {"megatron": "dp=60,tp=8,pp=8,mbs=1,recompute=full", "tp4": "dp=120,tp=4,pp=8,mbs=1,recompute=full"}, nodes=480
    )
    assert len(c) == 3
    names = [r.name for r in c]
    assert names[1:] == ["megatron", "tp4"]
    df = c.to_pandas()
    assert list(df.index) == names
    assert df.loc["megatron", "step_time_s"] == c.rows[1].predicted.step_time_s
    assert c.rows[0].predicted.step_time_s <= min(r.predicted.step_time_s for r in c.rows)
    svg = c._repr_svg_()
    assert svg.lstrip().startswith("<svg") or svg.lstrip().startswith("<?xml")
    assert "<table>" in c._repr_html_()


def test_explain_and_export(tmp_path):
    p = meshplan.plan(TINY, CPU, output=tmp_path / "tiny.json")
    assert p.path == tmp_path / "tiny.json" and p.path.exists()
    x = meshplan.explain(p)
    want = json.loads(cli("explain", p.path, "--json").stdout)
    assert x.raw == want
    text = meshplan.export(p, "megatron")
    assert text == cli("export", p.path, "--to", "megatron").stdout
    assert "--tensor-model-parallel-size" in text


def test_inputs_as_dicts_and_hf_config():
    hf = json.loads((ROOT / "models" / "hf" / "llama3-8b-transformers5.json").read_text())
    info = meshplan.inspect(hf, seq_len=8192, global_batch=8)
    assert info.params_total == pytest.approx(8.03e9, rel=0.01)
    assert info.dtype == "bf16"
    # The CPU mesh's YAML as a dict, and tiny-gpt's model as a dict with another dtype.
    cluster = {
        "name": "cpu-test-mesh",
        "nodes": 1,
        "gpus_per_node": 8,
        "gpu": {
            "name": "cpu-thread",
            "memory_gib": 2,
            "peak_tflops": {"bf16": 0.05, "fp16": 0.05, "fp32": 0.1},
            "hbm_gbps": 10,
        },
        "intra_node": {"link": "shared-memory", "bandwidth_gbps": 5, "latency_us": 5},
    }
    assert meshplan.estimate(TINY, cluster, "dp=8") == meshplan.estimate(TINY, CPU, "dp=8")
    model = {
        "name": "dict-model",
        "transformer": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256},
        "dtype": "float32",
        "workload": {"kind": "train", "seq_len": 64, "global_batch": 8},
    }
    m = meshplan.inspect(model)
    assert m.name == "dict-model" and m.dtype == "f32"


def test_a_padded_vocabulary_lets_tp_split_gpt2_from_its_config_json():
    gpt2 = str(ROOT / "models" / "hf" / "gpt2.json")
    h100 = str(ROOT / "topologies" / "dgx-h100.yaml")
    batch = dict(seq_len=1024, global_batch=512, config={"tp": 2})
    with pytest.raises(meshplan.BadInput) as e:
        meshplan.plan(gpt2, h100, **batch)
    assert "--make-vocab-size-divisible-by 128" in e.value.message
    p = meshplan.plan(gpt2, h100, make_vocab_size_divisible_by=128, **batch)
    assert p.strategy["tp"] == 2
    assert json.loads(p.path.read_text())["model"]["transformer"]["make_vocab_size_divisible_by"] == 128
    # The padded rows (50304 of 50257 tokens) are priced: more parameters.
    padded = meshplan.inspect(gpt2, make_vocab_size_divisible_by=128, seq_len=1024, global_batch=512)
    plain = meshplan.inspect(gpt2, seq_len=1024, global_batch=512)
    assert padded.params_total - plain.params_total == 47 * 768


def test_errors_carry_the_clis_message_and_class(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(meshplan.BadInput) as e:
        meshplan.plan(missing, A100)
    assert e.value.code == 2
    err = cli("plan", missing, A100, code=2).stderr
    assert e.value.message in err
    assert isinstance(e.value, ValueError)
    with pytest.raises(meshplan.BadInput):
        meshplan.estimate(GPT3, A100, "tp=eight", nodes=480)
    # Does not fit: exit 3.
    with pytest.raises(meshplan.Infeasible) as e:
        meshplan.estimate(GPT3, A100, "dp=3840,tp=1,pp=1", nodes=480)
    assert e.value.code == 3


def test_notebook_style_session(tmp_path):
    """Cells run one after another in one namespace, displayed as Jupyter would
    (the rich reprs are what a notebook shows)."""
    cells = [
        "import meshplan",
        f"p = meshplan.plan({TINY!r}, {CPU!r})",
        "html = p._repr_html_(); svg = p._repr_svg_()",
        f"c = meshplan.compare({TINY!r}, {CPU!r}, ['dp=8'])",
        "df = c.to_pandas()",
        "x = meshplan.explain(p)",
    ]
    ns = {}
    for cell in cells:
        exec(cell, ns)
    assert "step_time_s" in ns["html"] and "<table>" in ns["html"]
    assert "<svg" in ns["svg"]
    assert len(ns["df"]) == 2
    assert meshplan.version()


def test_deploy_equals_the_cli(tmp_path):
    llama = str(ROOT / "models" / "llama3-70b-inference.yaml")
    h200 = str(ROOT / "topologies" / "h200-node.yaml")
    d = meshplan.deploy(llama, h200)
    want = json.loads(cli("deploy", llama, h200, "-o", tmp_path / "d.json", "--json").stdout)
    assert d.mode == want["mode"]
    assert d.best == want["best"]
    assert d.frontier == want["frontier"]
    assert d.verdict == want["verdict"] and " wins: " in d.verdict
    assert d.tokens_per_s_per_gpu == want["best"]["output_tokens_per_s_per_gpu"]
    assert json.loads(d.path.read_text())["serving"]["mode"] == d.mode
    assert "<svg" in d._repr_svg_() and "tokens/s per GPU" in d._repr_html_()
    frame = d.to_pandas()
    assert len(frame) == len(d.frontier)
    # A workload as a dict, pools fixed, and an SLO nothing meets raises Infeasible.
    w = {"kind": "inference", "prompt_len": 2048, "output_len": 256,
         "slo": {"ttft_ms": 2000, "tpot_ms": 50}, "serving": {"mode": "disaggregated"}}
    p = meshplan.deploy(llama, h200, workload=w, decode_config={"tp": 4})
    assert p.mode == "disaggregated" and p.best["decode"]["config"]["tp"] == 4
    with pytest.raises(meshplan.Infeasible, match="closest misses"):
        meshplan.deploy(llama, h200, workload={**w, "slo": {"tpot_ms": 1}})
