"""Families `meshplan plan` reads from a config.json but `--weights` does not run,
and a family it does not read: each must exit 2 naming `model_type`, never run.

| case | expected |
|---|---|
| deepseek_v3 (MLA + MoE) | refused at run: --weights reads llama, mistral, qwen2, mixtral, gpt2 |
| qwen3 (q/k norms: not Qwen2) | refused at plan: model_type not supported |
"""

import hfcheck
from hfcheck import Case, Refuse

CASES = [
    Case("deepseek_v3", "deepseek_v3", expect=Refuse("model_type")),
    Case("qwen3", "qwen3", expect=Refuse("model_type")),
]

globals().update(hfcheck.tests(CASES))
