#!/usr/bin/env python3
"""Extracts the option names each framework defines, from its released source, into
the lists `tests/it/export.rs` checks every exported option against.

Usage (downloads are by hand, never at test time):

    pip download --no-deps --only-binary :all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 megatron-core==0.19.2
    pip download --no-deps --only-binary :all: torchtitan==0.2.2
    pip download --no-deps --only-binary :all: vllm==0.34.0
    pip download --no-deps --only-binary :all: sglang==0.5.23
    # deepspeed publishes only an sdist: deepspeed-0.19.8.tar.gz
    python3 extract_options.py DOWNLOAD_DIR

Static reading (ast), no import: the frameworks need torch and a GPU to import.

- megatron: `add_argument('--x', ...)` literals in megatron/training/arguments.py,
  plus the flags `ArgumentGroupFactory(Config, exclude=[...])` derives from a
  dataclass's fields (`--field-name`; `--no-`/`--disable-` for booleans that
  default to True; `argparse_meta["arg_names"]` where given).
- torchtitan: `section.field` for each dataclass field of each `JobConfig` section
  (torchtitan/config/job_config.py; the TOML file's `[section]` and keys).
- deepspeed: top-level keys (string constants of deepspeed/runtime/constants.py) and
  `section.key` for zero_optimization (DeepSpeedZeroConfig fields and aliases),
  bf16/fp16 (precision_config.py fields) and activation_checkpointing (its
  config.py constants); the section names from ZERO_OPTIMIZATION and ACT_CHKPT.
- vllm: `--x` literals in vllm/engine/arg_utils.py.
- sglang: `--field-name` (or `Arg(cli_name=...)`) and `Arg(aliases=[...])` of the
  annotated fields in sglang/srt/arg_groups/fields/*.py, plus `--x` literals passed
  to `add_argument` in sglang/srt.
"""

import ast
import glob
import os
import re
import sys
import tarfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*$")


def archive(dl, pattern):
    hits = sorted(glob.glob(os.path.join(dl, "**", pattern), recursive=True))
    if not hits:
        sys.exit(f"{dl}: no {pattern}")
    return hits[-1]


def read_members(path, wanted):
    """{member name: source} for members matching the regex `wanted`."""
    out = {}
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
            for n in z.namelist():
                if re.search(wanted, n):
                    out[n] = z.read(n).decode()
    else:
        with tarfile.open(path) as t:
            for m in t.getmembers():
                if m.isfile() and re.search(wanted, m.name):
                    out[m.name] = t.extractfile(m).read().decode()
    return out


def version_of(path):
    base = os.path.basename(path)
    m = re.match(r"([A-Za-z0-9_]+)-([0-9][^-]*?)(?:-|\.tar\.gz)", base)
    return m.group(1).replace("_", "-"), m.group(2)


def add_argument_literals(tree):
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            for a in node.args:
                if isinstance(a, ast.Constant) and isinstance(a.value, str) and FLAG.match(a.value):
                    names.add(a.value)
    return names


def dataclasses_in(sources):
    """{class name: (base names, [(field, annotation node, value node)])}."""
    classes = {}
    for src in sources.values():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef):
                fields = []
                for st in node.body:
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                        fields.append((st.target.id, st.annotation, st.value))
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                classes.setdefault(node.name, (bases, fields))
    return classes


def all_fields(classes, name, seen=None):
    seen = seen or set()
    if name not in classes or name in seen:
        return []
    seen.add(name)
    bases, fields = classes[name]
    out = []
    for b in bases:
        out.extend(all_fields(classes, b, seen))
    out.extend(fields)
    return out


def kw(call, key):
    for k in call.keywords:
        if k.arg == key:
            return k.value
    return None


def str_list(node, env):
    if isinstance(node, ast.Name) and node.id in env:
        node = env[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def megatron(dl):
    path = archive(dl, "megatron_core-*.whl")
    src = read_members(path, r"^megatron/.*\.py$")
    tree = ast.parse(src["megatron/training/arguments.py"])
    names = add_argument_literals(tree)
    classes = dataclasses_in(src)
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        env = {}
        for st in ast.walk(fn):
            if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
                env[st.targets[0].id] = st.value
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and getattr(call.func, "id", "") == "ArgumentGroupFactory"):
                continue
            cls = call.args[0].id
            exclude = set(str_list(kw(call, "exclude"), env))
            for field, ann, value in all_fields(classes, cls):
                if field in exclude or field.startswith("_"):
                    continue
                meta_names = None
                default = value
                if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
                    if isinstance(kw(value, "init"), ast.Constant) and kw(value, "init").value is False:
                        continue
                    default = kw(value, "default")
                    md = kw(value, "metadata")
                    if isinstance(md, ast.Dict):
                        for k, v in zip(md.keys, md.values):
                            if isinstance(k, ast.Constant) and k.value == "argparse_meta" and isinstance(v, ast.Dict):
                                for k2, v2 in zip(v.keys, v.values):
                                    if isinstance(k2, ast.Constant) and k2.value == "arg_names":
                                        meta_names = str_list(v2, {})
                if meta_names:
                    names.update(meta_names)
                elif isinstance(ann, ast.Name) and ann.id == "bool" and isinstance(default, ast.Constant) and default.value is True:
                    names.add("--no-" + field.replace("_", "-"))
                    names.add("--disable-" + field.replace("_", "-"))
                else:
                    names.add("--" + field.replace("_", "-"))
    return path, names


def torchtitan(dl):
    path = archive(dl, "torchtitan-*.whl")
    src = read_members(path, r"^torchtitan/config/job_config\.py$")
    classes = dataclasses_in(src)
    names = set()
    for section, ann, _ in classes["JobConfig"][1]:
        cls = ann.id if isinstance(ann, ast.Name) else None
        for field, _, _ in all_fields(classes, cls):
            names.add(f"{section}.{field}")
    return path, names


def deepspeed(dl):
    path = archive(dl, "deepspeed-*.tar.gz")
    src = read_members(path, r"deepspeed/runtime/(constants|precision_config|zero/config|activation_checkpointing/config)\.py$")
    get = lambda suffix: next(v for k, v in src.items() if k.endswith(suffix))
    names = set()
    for node in ast.walk(ast.parse(get("runtime/constants.py"))):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            if re.match(r"^[a-z][a-z0-9_]*$", node.value.value):
                names.add(node.value.value)

    def model_fields(source, cls):
        out = set()
        classes = dataclasses_in({"x": source})
        for field, _, value in all_fields(classes, cls):
            out.add(field)
            if isinstance(value, ast.Call):
                alias = kw(value, "alias")
                if isinstance(alias, ast.Constant):
                    out.add(alias.value)
        return out

    # Section names defined beside their sections' fields.
    for suffix, const in [("zero/config.py", "ZERO_OPTIMIZATION"), ("activation_checkpointing/config.py", "ACT_CHKPT")]:
        for node in ast.walk(ast.parse(get(suffix))):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id == const:
                names.add(node.value.value)
    for f in model_fields(get("zero/config.py"), "DeepSpeedZeroConfig"):
        names.add(f"zero_optimization.{f}")
    prec = get("runtime/precision_config.py")
    for section, cls in [("bf16", "DeepSpeedBF16Config"), ("fp16", "DeepSpeedFP16Config")]:
        for f in model_fields(prec, cls):
            names.add(f"{section}.{f}")
    for node in ast.walk(ast.parse(get("activation_checkpointing/config.py"))):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            t = node.targets[0]
            if isinstance(t, ast.Name) and t.id.startswith("ACT_CHKPT_") and not t.id.endswith("_DEFAULT"):
                names.add(f"activation_checkpointing.{node.value.value}")
    return path, names


def vllm(dl):
    path = archive(dl, "vllm-*.whl")
    src = read_members(path, r"^vllm/engine/arg_utils\.py$")
    names = set()
    for node in ast.walk(ast.parse(src["vllm/engine/arg_utils.py"])):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and FLAG.match(node.value):
            names.add(node.value)
    return path, names


def sglang(dl):
    path = archive(dl, "sglang-*.whl")
    src = read_members(path, r"^sglang/srt/(server_args\.py|arg_groups/.*\.py)$")
    names = set()
    for name, text in src.items():
        tree = ast.parse(text)
        names |= add_argument_literals(tree)
        if "/arg_groups/fields/" not in name:
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            ann = node.annotation
            if not (isinstance(ann, ast.Subscript) and getattr(ann.value, "id", "") == "A"):
                continue
            parts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
            arg = next((p for p in parts if isinstance(p, ast.Call) and getattr(p.func, "id", "") == "Arg"), None)
            if arg is not None and isinstance(kw(arg, "no_cli"), ast.Constant) and kw(arg, "no_cli").value:
                continue
            cli = kw(arg, "cli_name") if arg is not None else None
            names.add(cli.value if isinstance(cli, ast.Constant) else "--" + node.target.id.replace("_", "-"))
            if arg is not None:
                names.update(str_list(kw(arg, "aliases"), {}))
    return path, names


def main():
    dl = sys.argv[1] if len(sys.argv) > 1 else "."
    for target, fn in [("megatron", megatron), ("torchtitan", torchtitan), ("deepspeed", deepspeed), ("vllm", vllm), ("sglang", sglang)]:
        path, names = fn(dl)
        pkg, version = version_of(path)
        out = os.path.join(HERE, f"{target}_options.txt")
        with open(out, "w") as f:
            f.write(f"# {pkg} {version}: option names, extracted by tests/data/frameworks/extract_options.py from {os.path.basename(path)}\n")
            for n in sorted(names):
                f.write(n + "\n")
        print(f"{out}: {len(names)} names from {pkg} {version}")


if __name__ == "__main__":
    main()
