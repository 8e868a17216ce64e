#!/usr/bin/env python3
"""Sums a `meshplan run --trace` timeline by op: where a step's time goes.

    scripts/trace_summary.py TRACE.json [--skip-steps 1] [--rank 0]

Prints, for one rank, each op kind's total milliseconds per step (forward and
backward apart, layers summed), its share of the step and its call count, largest
first. The first steps are skipped (kernel compilation and allocation warm-up).
"""

import argparse
import collections
import json
import re


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--skip-steps", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0, help="thread id (tid) of the rank")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    t = json.load(open(a.trace))
    events = t["traceEvents"] if isinstance(t, dict) else t
    total = collections.defaultdict(float)
    count = collections.Counter()
    steps = set()
    for e in events:
        if e.get("ph") != "X" or e.get("tid") != a.rank:
            continue
        step = (e.get("args") or {}).get("step", 0)
        if step < a.skip_steps or e.get("cat") == "task":
            continue
        steps.add(step)
        # Micro-batch and chunk numbers are not kinds of op.
        name = re.sub(r" mb\d+| c\d+", "", e["name"])
        total[(e.get("cat"), name)] += e["dur"] / 1e3
        count[(e.get("cat"), name)] += 1
    n = max(1, len(steps))
    whole = sum(total.values()) / n
    print(f"{a.trace}: rank {a.rank}, {n} steps, {whole:.2f} ms of ops per step")
    print(f"{'ms/step':>9} {'share':>6} {'calls':>6}  op")
    for key, ms in sorted(total.items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"{ms / n:9.3f} {ms / n / whole:6.1%} {count[key] // n:6d}  {key[1]} ({key[0]})")


if __name__ == "__main__":
    main()
