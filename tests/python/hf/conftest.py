"""Fixtures of the Hugging Face fidelity suite (see hfcheck.py and run.sh)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import hfcheck  # noqa: E402
import transformers  # noqa: E402

transformers.utils.logging.disable_progress_bar()
# The references are tiny: one thread, leaving the other core to meshplan's ranks.
torch.set_num_threads(1)


def pytest_sessionstart(session):
    b = hfcheck.meshplan_bin()
    if not b.is_file() or not os.access(b, os.X_OK):
        raise pytest.UsageError(
            f"no meshplan binary at {b}: build it (cargo build --release) or set MESHPLAN_BIN"
        )


@dataclass
class Built:
    dir: Path
    ref: hfcheck.Generation
    # Without the EOS the case sets (eos cases only): the generation EOS must cut.
    free: hfcheck.Generation | None = None


class Builder:
    def __init__(self, root: Path):
        self.root = root
        self.cache: dict[str, Built] = {}

    def __call__(self, case: hfcheck.Case) -> Built:
        if case.id in self.cache:
            return self.cache[case.id]
        d = self.root / case.id
        if d.exists():
            shutil.rmtree(d)
        free = None
        eos = None
        if case.eos_step is not None:
            base = hfcheck.save_checkpoint(case, d / "no-eos")
            free = hfcheck.generate(hfcheck.load(base), case.new_tokens)
            eos = hfcheck.eos_from(free, case)
        ckpt = hfcheck.save_checkpoint(case, d / "ckpt", eos=eos)
        ref = hfcheck.generate(hfcheck.load(ckpt), case.new_tokens)
        b = Built(ckpt, ref, free)
        self.cache[case.id] = b
        return b


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Builder:
    return Builder(tmp_path_factory.mktemp("hf"))
