"""meshplan from Python: plan, deploy, estimate, compare, explain, inspect and export.

Each function runs the command line's own code in-process (the compiled
``meshplan._native`` module) with the arguments a user would type, and returns the
JSON object that command prints with ``--json`` as typed objects whose attribute
names are the contract's keys. Nothing is decided here: defaults, checks and
messages are the command line's, and so are the numbers::

    import meshplan
    p = meshplan.plan("models/gpt3-175b.yaml", "topologies/dgx-a100-80g.yaml", nodes=480)
    p.step_time_s, p.strategy["tp"], p.predicted.mfu

A model or cluster is a path, or a dict (a model YAML's mapping, a Hugging Face
``config.json``'s object, a cluster YAML's mapping), written to a temporary file
for the command. Failures raise :class:`BadInput` (exit code 2), :class:`Infeasible`
(3) or :class:`MeshplanError` (1), carrying the command line's message.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from . import _native

__all__ = [
    "BadInput",
    "Comparison",
    "ComparisonRow",
    "Deployment",
    "Explanation",
    "Infeasible",
    "MeshplanError",
    "ModelInfo",
    "Plan",
    "Prediction",
    "compare",
    "deploy",
    "estimate",
    "explain",
    "export",
    "inspect",
    "plan",
    "version",
]

PathLike = Union[str, "os.PathLike[str]"]
Model = Union[PathLike, Mapping[str, Any]]
Cluster = Union[PathLike, Mapping[str, Any]]
Config = Union[str, Mapping[str, Any]]


# === errors ===


class MeshplanError(Exception):
    """A meshplan failure. ``code`` is the command line's exit code (1 runtime,
    2 bad input, 3 does not fit) and ``message`` its message."""

    code: int = 1

    def __init__(self, message: str, code: Optional[int] = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class BadInput(MeshplanError, ValueError):
    """Exit code 2: a file, field or argument is wrong; the message names it and the fix."""

    code = 2


class Infeasible(MeshplanError):
    """Exit code 3: the configuration does not fit, or no configuration does."""

    code = 3


def _raise(e: Exception) -> None:
    code, message = e.args
    cls = {2: BadInput, 3: Infeasible}.get(code, MeshplanError)
    raise cls(message, code) from None


def _run(args: List[str]) -> Any:
    try:
        return json.loads(_native.run_json([str(a) for a in args]))
    except _native.NativeError as e:
        _raise(e)


def version() -> str:
    """The version of meshplan the module was built from."""
    return _native.version()


# === results ===


def _opt_float(d: Mapping[str, Any], key: str) -> Optional[float]:
    v = d.get(key)
    return None if v is None else float(v)


@dataclass(frozen=True)
class Prediction:
    """The cost model's estimate of one configuration (the contract's JSON output
    keys). Keys beyond these are in ``raw``."""

    feasible: bool
    config: Dict[str, Any]
    step_time_s: Optional[float]
    tokens_per_s: Optional[float]
    model_tflops_per_gpu: Optional[float]
    hardware_tflops_per_gpu: Optional[float]
    mfu: Optional[float]
    hfu: Optional[float]
    memory_per_gpu_bytes: Dict[str, float]
    time_breakdown_s: Dict[str, float]
    comm_bytes_per_gpu: Dict[str, float]
    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None
    output_tokens_per_s: Optional[float] = None
    max_concurrency: Optional[float] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Prediction":
        return cls(
            feasible=bool(d.get("feasible", False)),
            config=dict(d.get("config") or {}),
            step_time_s=_opt_float(d, "step_time_s"),
            tokens_per_s=_opt_float(d, "tokens_per_s"),
            model_tflops_per_gpu=_opt_float(d, "model_tflops_per_gpu"),
            hardware_tflops_per_gpu=_opt_float(d, "hardware_tflops_per_gpu"),
            mfu=_opt_float(d, "mfu"),
            hfu=_opt_float(d, "hfu"),
            memory_per_gpu_bytes=dict(d.get("memory_per_gpu_bytes") or {}),
            time_breakdown_s=dict(d.get("time_breakdown_s") or {}),
            comm_bytes_per_gpu=dict(d.get("comm_bytes_per_gpu") or {}),
            ttft_s=_opt_float(d, "ttft_s"),
            tpot_s=_opt_float(d, "tpot_s"),
            output_tokens_per_s=_opt_float(d, "output_tokens_per_s"),
            max_concurrency=_opt_float(d, "max_concurrency"),
            raw=dict(d),
        )

    def _repr_html_(self) -> str:
        return _table(
            [(k, _fmt(getattr(self, k))) for k in _SUMMARY_KEYS if getattr(self, k) is not None]
        )


_SUMMARY_KEYS = (
    "feasible",
    "step_time_s",
    "tokens_per_s",
    "mfu",
    "hfu",
    "ttft_s",
    "tpot_s",
    "output_tokens_per_s",
)


@dataclass(frozen=True)
class Plan:
    """A plan written by ``meshplan plan``: its configuration (``strategy``), the
    prediction, how it was found, and the plan file (``path``) that ``run``,
    ``explain`` and ``export`` take."""

    path: Path
    strategy: Dict[str, Any]
    predicted: Prediction
    search: Dict[str, Any]
    layer_split: Optional[List[int]] = None
    top: List[Dict[str, Any]] = field(default_factory=list, repr=False)
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def step_time_s(self) -> Optional[float]:
        """Seconds per optimizer step (training plans)."""
        return self.predicted.step_time_s

    @property
    def config(self) -> str:
        """The configuration in the ``--config`` spelling."""
        return _config_text(self.strategy)

    def figures(self, directory: Optional[PathLike] = None) -> Dict[str, Path]:
        """Draws the plan's figures (pipeline schedule, memory, mesh) as SVG files in
        ``directory`` (a temporary one by default): name -> path."""
        out = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="meshplan-figures-"))
        _run(["draw", self.path, "-o", out])
        return {p.stem: p for p in sorted(out.glob("*.svg"))}

    def _repr_svg_(self) -> str:
        figs = self.figures()
        first = next(iter(figs.values()), None)
        return first.read_text() if first is not None else ""

    def _repr_html_(self) -> str:
        rows = [("configuration", self.config)]
        rows += [(k, _fmt(getattr(self.predicted, k))) for k in _SUMMARY_KEYS if getattr(self.predicted, k) is not None]
        rows.append(("plan file", str(self.path)))
        return _table(rows)


@dataclass(frozen=True)
class ComparisonRow:
    """One row of ``compare``: a configuration's name, its configuration in the
    ``--config`` spelling (``strategy``), its prediction, its step time over the
    planner's best (``ratio_to_planner``) and what differs (``account``)."""

    name: str
    strategy: str
    predicted: Prediction
    ratio_to_planner: Optional[float] = None
    account: str = ""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class Comparison:
    """``compare``'s rows, the planner's best first."""

    rows: List[ComparisonRow]
    figures: Dict[str, Path] = field(default_factory=dict)
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __iter__(self) -> Iterator[ComparisonRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def to_pandas(self):
        """The rows as a pandas DataFrame, one column per prediction key (needs
        pandas: ``pip install meshplan[pandas]``)."""
        try:
            import pandas as pd
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("Comparison.to_pandas needs pandas: pip install 'meshplan[pandas]'") from e
        records = []
        for r in self.rows:
            rec: Dict[str, Any] = {
                "name": r.name,
                "config": r.strategy,
                "ratio_to_planner": r.ratio_to_planner,
                "account": r.account,
            }
            for f in fields(Prediction):
                if f.name in ("raw", "config", "memory_per_gpu_bytes", "time_breakdown_s", "comm_bytes_per_gpu"):
                    continue
                rec[f.name] = getattr(r.predicted, f.name)
            rec["memory_total_bytes"] = r.predicted.memory_per_gpu_bytes.get("total")
            records.append(rec)
        return pd.DataFrame.from_records(records).set_index("name")

    def _repr_svg_(self) -> str:
        svg = next(iter(self.figures.values()), None)
        return svg.read_text() if svg is not None else ""

    def _repr_html_(self) -> str:
        head = "<tr><th>name</th><th>configuration</th><th>step time (s)</th><th>ratio</th><th>MFU</th></tr>"
        body = "".join(
            f"<tr><td>{_esc(r.name)}</td><td>{_esc(r.strategy)}</td>"
            f"<td>{_fmt(r.predicted.step_time_s)}</td><td>{_fmt(r.ratio_to_planner)}</td>"
            f"<td>{_fmt(r.predicted.mfu)}</td></tr>"
            for r in self.rows
        )
        return f"<table>{head}{body}</table>"


@dataclass(frozen=True)
class Deployment:
    """A serving deployment from ``meshplan deploy``: the best within the SLOs
    (``best``, with ``mode`` aggregated or disaggregated), the best of each mode,
    the ``verdict`` saying which wins and why, the throughput-latency ``frontier``
    (dicts with the contract's keys: ``output_tokens_per_s_per_gpu``,
    ``output_tokens_per_s_per_user``, ``ttft_s``, ``tpot_s``, ``decode``,
    ``prefill``, ``kv_transfer``), and the plan file (``path``)."""

    path: Path
    mode: str
    best: Dict[str, Any]
    frontier: List[Dict[str, Any]]
    verdict: Optional[str] = None
    best_aggregated: Optional[Dict[str, Any]] = None
    best_disaggregated: Optional[Dict[str, Any]] = None
    search: Dict[str, Any] = field(default_factory=dict)
    figure: Optional[Path] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Output tokens per second per GPU of the best deployment."""
        return self.best["output_tokens_per_s_per_gpu"]

    def to_pandas(self):
        """The frontier as a pandas DataFrame, one row per deployment (needs pandas)."""
        try:
            import pandas as pd
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("Deployment.to_pandas needs pandas: pip install 'meshplan[pandas]'") from e
        records = []
        for p in self.frontier:
            rec = {k: v for k, v in p.items() if not isinstance(v, (dict, type(None)))}
            rec["decode"] = p["decode"]["strategy"]
            rec["prefill"] = (p.get("prefill") or {}).get("strategy")
            records.append(rec)
        return pd.DataFrame.from_records(records)

    def _repr_svg_(self) -> str:
        return self.figure.read_text() if self.figure is not None else ""

    def _repr_html_(self) -> str:
        b = self.best
        rows = [
            ("mode", _esc(self.mode)),
            ("tokens/s per GPU", _fmt(b["output_tokens_per_s_per_gpu"])),
            ("tokens/s per user", _fmt(b["output_tokens_per_s_per_user"])),
            ("TTFT (s)", _fmt(b["ttft_s"])),
            ("TPOT (s)", _fmt(b["tpot_s"])),
            ("GPUs", _fmt(b["gpus"])),
            ("verdict", _fmt(self.verdict or "")),
            ("plan file", _esc(str(self.path))),
        ]
        return _table(rows)


@dataclass(frozen=True)
class Explanation:
    """``explain``: why the plan and not its neighbours (the keys of ``explain
    --json`` are in ``raw``; the common ones are attributes)."""

    raw: Dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.raw[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass(frozen=True)
class ModelInfo:
    """``inspect``: parameters, FLOPs per token and the memory of one unsharded
    replica."""

    name: str
    dtype: str
    params_total: float
    params_active: float
    flops_per_token_forward: float
    flops_per_token_train: float
    seq_len: int
    memory_bytes: Dict[str, float]
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


# === commands ===


def plan(
    model: Model,
    cluster: Cluster,
    *,
    nodes: Optional[int] = None,
    config: Optional[Config] = None,
    framework: Optional[str] = None,
    top: Optional[int] = None,
    output: Optional[PathLike] = None,
    calibration: Optional[PathLike] = None,
    seq_len: Optional[int] = None,
    global_batch: Optional[int] = None,
    workload: Optional[Union[PathLike, Mapping[str, Any]]] = None,
    make_vocab_size_divisible_by: Optional[int] = None,
) -> Plan:
    """``meshplan plan``: searches the best layout of ``model`` on ``cluster`` and
    writes the plan file (``output``, a temporary file by default)."""
    with _Inputs() as tmp:
        out = Path(output) if output is not None else tmp.keep("plan.json")
        args = ["plan", tmp.model(model), tmp.cluster(cluster), "-o", out, "--json"]
        args += _common(nodes, config, framework, calibration, seq_len, global_batch, workload, tmp, make_vocab_size_divisible_by)
        if top is not None:
            args += ["--top", str(top)]
        d = _run(args)
    return Plan(
        path=out,
        strategy=dict(d.get("strategy") or {}),
        predicted=Prediction.from_json(d.get("predicted") or {}),
        search=dict(d.get("search") or {}),
        layer_split=d.get("layer_split"),
        top=list(d.get("top") or []),
        raw=d,
    )


def deploy(
    model: Model,
    cluster: Cluster,
    *,
    nodes: Optional[int] = None,
    config: Optional[Config] = None,
    prefill_config: Optional[Config] = None,
    decode_config: Optional[Config] = None,
    dcp: Optional[int] = None,
    output: Optional[PathLike] = None,
    calibration: Optional[PathLike] = None,
    workload: Optional[Union[PathLike, Mapping[str, Any]]] = None,
    make_vocab_size_divisible_by: Optional[int] = None,
) -> Deployment:
    """``meshplan deploy``: the best serving deployment of ``model`` on ``cluster``
    within the workload's SLOs, and the frontier; writes the plan file (``output``,
    a temporary file by default) and the frontier figure."""
    with _Inputs() as tmp:
        out = Path(output) if output is not None else tmp.keep("deploy.json")
        figures = Path(tempfile.mkdtemp(prefix="meshplan-frontier-"))
        args = ["deploy", tmp.model(model), tmp.cluster(cluster), "-o", out, "--figures", figures, "--json"]
        args += _common(nodes, config, None, calibration, None, None, workload, tmp, make_vocab_size_divisible_by)
        for flag, keys in (("--prefill-config", prefill_config), ("--decode-config", decode_config)):
            if keys is not None:
                args += [flag, _config_text(keys)]
        if dcp is not None:
            args += ["--dcp", str(dcp)]
        d = _run(args)
    svg = figures / "frontier.svg"
    return Deployment(
        path=out,
        mode=d["mode"],
        best=d["best"],
        frontier=list(d.get("frontier") or []),
        verdict=d.get("verdict"),
        best_aggregated=d.get("best_aggregated"),
        best_disaggregated=d.get("best_disaggregated"),
        search=dict(d.get("search") or {}),
        figure=svg if svg.exists() else None,
        raw=d,
    )


def estimate(
    model: Model,
    cluster: Cluster,
    config: Config,
    *,
    nodes: Optional[int] = None,
    framework: Optional[str] = None,
    calibration: Optional[PathLike] = None,
    seq_len: Optional[int] = None,
    global_batch: Optional[int] = None,
    workload: Optional[Union[PathLike, Mapping[str, Any]]] = None,
    make_vocab_size_divisible_by: Optional[int] = None,
) -> Prediction:
    """``meshplan estimate``: one hand-given configuration, priced without a search."""
    with _Inputs() as tmp:
        args = ["estimate", tmp.model(model), tmp.cluster(cluster), "--json"]
        args += _common(nodes, config, framework, calibration, seq_len, global_batch, workload, tmp, make_vocab_size_divisible_by)
        return Prediction.from_json(_run(args))


def compare(
    model: Model,
    cluster: Cluster,
    configs: Union[Sequence[Config], Mapping[str, Config]],
    *,
    nodes: Optional[int] = None,
    framework: Optional[str] = None,
    calibration: Optional[PathLike] = None,
    seq_len: Optional[int] = None,
    global_batch: Optional[int] = None,
    workload: Optional[Union[PathLike, Mapping[str, Any]]] = None,
    make_vocab_size_divisible_by: Optional[int] = None,
    figures: Optional[PathLike] = None,
) -> Comparison:
    """``meshplan compare``: the planner's best beside each configuration (a list,
    or names -> configurations). ``figures`` names a directory for the comparison
    figure (a temporary one by default, shown inline in Jupyter)."""
    with _Inputs() as tmp:
        fig_dir = Path(figures) if figures is not None else Path(tempfile.mkdtemp(prefix="meshplan-compare-"))
        args = ["compare", tmp.model(model), tmp.cluster(cluster), "--json", "--figures", fig_dir]
        if isinstance(configs, Mapping):
            listed = [{"name": str(k), "config": _config_text(v)} for k, v in configs.items()]
            args += ["--configs", tmp.write("configs.yaml", json.dumps(listed))]
        else:
            for c in configs:
                args += ["--config", _config_text(c)]
        args += _common(nodes, None, framework, calibration, seq_len, global_batch, workload, tmp, make_vocab_size_divisible_by)
        d = _run(args)
    rows = [
        ComparisonRow(
            name=str(r.get("name", "")),
            strategy=str(r.get("strategy", "")),
            predicted=Prediction.from_json(r.get("predicted") or {}),
            ratio_to_planner=_opt_float(r, "ratio_to_planner"),
            account=str(r.get("account", "")),
            raw=r,
        )
        for r in d.get("rows", [])
    ]
    return Comparison(rows=rows, figures={p.stem: p for p in sorted(fig_dir.glob("*.svg"))}, raw=d)


def explain(plan: Union[Plan, PathLike], *, top: Optional[int] = None) -> Explanation:
    """``meshplan explain``: the plan's neighbours and why they lose."""
    args = ["explain", _plan_path(plan), "--json"]
    if top is not None:
        args += ["--top", str(top)]
    return Explanation(raw=_run(args))


def inspect(
    model: Model,
    *,
    seq_len: Optional[int] = None,
    global_batch: Optional[int] = None,
    workload: Optional[Union[PathLike, Mapping[str, Any]]] = None,
    make_vocab_size_divisible_by: Optional[int] = None,
) -> ModelInfo:
    """``meshplan inspect``: parameters, FLOPs per token, memory of one replica."""
    with _Inputs() as tmp:
        args = ["inspect", tmp.model(model), "--json"]
        args += _common(None, None, None, None, seq_len, global_batch, workload, tmp, make_vocab_size_divisible_by)
        d = _run(args)
    return ModelInfo(
        name=d["name"],
        dtype=d.get("dtype", ""),
        params_total=float(d["params_total"]),
        params_active=float(d["params_active"]),
        flops_per_token_forward=float(d["flops_per_token_forward"]),
        flops_per_token_train=float(d["flops_per_token_train"]),
        seq_len=int(d["seq_len"]),
        memory_bytes=dict(d["memory_bytes"]),
        raw=d,
    )


def export(plan: Union[Plan, PathLike], to: Optional[str] = None, *, output: Optional[PathLike] = None) -> str:
    """``meshplan export``: the plan as a framework's launch configuration
    (``to``: megatron, torchtitan, deepspeed, sglang, vllm; default the plan's own
    framework). Returns the text, also written to ``output`` when given."""
    with _Inputs() as tmp:
        out = Path(output) if output is not None else Path(tmp.dir) / "export.out"
        args = ["export", _plan_path(plan), "-o", out]
        if to is not None:
            args += ["--to", to]
        _run(args)
        return out.read_text()


# === arguments ===


def _config_text(c: Config) -> str:
    if isinstance(c, str):
        return c
    parts = []
    for k, v in c.items():
        if v is None:
            continue
        if isinstance(v, bool):
            v = "true" if v else "false"
        parts.append(f"{k}={v}")
    return ",".join(parts)


def _common(nodes, config, framework, calibration, seq_len, global_batch, workload, tmp, vocab_multiple=None) -> List[str]:
    args: List[str] = []
    if vocab_multiple is not None:
        # Megatron-LM's padding of the vocabulary, so that tp can split it.
        args += ["--make-vocab-size-divisible-by", str(vocab_multiple)]
    if nodes is not None:
        args += ["--nodes", str(nodes)]
    if config is not None:
        args += ["--config", _config_text(config)]
    if framework is not None:
        args += ["--framework", framework]
    if calibration is not None:
        args += ["--calibration", str(calibration)]
    if seq_len is not None:
        args += ["--seq-len", str(seq_len)]
    if global_batch is not None:
        args += ["--global-batch", str(global_batch)]
    if workload is not None:
        w = workload if not isinstance(workload, Mapping) else tmp.write("workload.yaml", json.dumps(dict(workload)))
        args += ["--workload", str(w)]
    return args


def _plan_path(plan: Union[Plan, PathLike]) -> str:
    return str(plan.path if isinstance(plan, Plan) else plan)


class _Inputs:
    """A temporary folder for the dicts given as inputs (YAML reads JSON)."""

    def __enter__(self) -> "_Inputs":
        self._tmp = tempfile.TemporaryDirectory(prefix="meshplan-")
        self.dir = self._tmp.name
        return self

    def __exit__(self, *exc) -> None:
        self._tmp.cleanup()

    def write(self, name: str, text: str) -> str:
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def keep(self, name: str) -> Path:
        """A path that outlives the folder (the plan file a Plan points at)."""
        fd, path = tempfile.mkstemp(prefix="meshplan-", suffix="-" + name)
        os.close(fd)
        return Path(path)

    def model(self, m: Model) -> str:
        if isinstance(m, Mapping):
            # A Hugging Face config.json names its family; a model YAML does not, and
            # is read as YAML (JSON text starting with a comment, so not taken for
            # a config.json).
            if "model_type" in m:
                return self.write("config.json", json.dumps(dict(m)))
            return self.write("model.yaml", "# meshplan model\n" + json.dumps(dict(m)))
        return os.fspath(m)

    def cluster(self, c: Cluster) -> str:
        if isinstance(c, Mapping):
            return self.write("cluster.yaml", json.dumps(dict(c)))
        return os.fspath(c)


# === display ===


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return _esc(str(v))


def _table(rows) -> str:
    body = "".join(f"<tr><th style='text-align:left'>{_esc(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"
