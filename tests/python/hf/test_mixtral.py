"""Mixtral checkpoints against meshplan: the router (`block_sparse_moe.gate`) and
each expert's w1, w3 and w2 read from the checkpoint, on one rank, with the experts
split over tp, over pipeline stages, and over ep (inside the data axis, and across
the tensor ranks).

| case | field | expected |
|---|---|---|
| mixtral | 4 experts, 2 a token, renormalised | exact |
| mixtral-top1 | num_experts_per_tok: 1 | exact |
"""

import hfcheck
from hfcheck import Case, reload_with

CASES = [
    Case(
        "mixtral",
        "mixtral",
        contrast=reload_with(num_experts_per_tok=1),
        plans=tuple(hfcheck.MOE_PLANS),
    ),
    Case(
        "mixtral-top1",
        "mixtral",
        {"num_experts_per_tok": 1},
        contrast=reload_with(num_experts_per_tok=2),
        plans=("moe-single", "moe-tp2", "moe-dp2ep2"),
    ),
]

globals().update(hfcheck.tests(CASES))
