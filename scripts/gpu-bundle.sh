#!/usr/bin/env bash
# Runs HERE (a machine with Rust, no GPU needed): builds the `--features cuda`
# meshplan binary and the kernels' and executor's test executables, and copies them
# with what they read into target/gpu-bundle/, for scripts/gpu-check.sh to run on a
# GPU machine that has CUDA 13 drivers, NCCL and PyTorch but no Rust.
#
#   scripts/gpu-bundle.sh        # then carry target/gpu-bundle to the GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
B=target/gpu-bundle
rm -rf "$B"
mkdir -p "$B/bin" "$B/tests"

cargo build --release --features cuda --bin meshplan
cp target/release/meshplan "$B/bin/meshplan"

# The unit-test executables (`--lib`), found from cargo's JSON messages.
for pkg in meshplan-kernels meshplan-executor; do
    exe=$(cargo test --release --features cuda -p "$pkg" --lib --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["executable"])
' | tail -n 1)
    if [ -z "$exe" ]; then
        echo "gpu-bundle: no test executable for $pkg" >&2
        exit 1
    fi
    cp "$exe" "$B/tests/$pkg"
done

if command -v strip >/dev/null; then
    strip "$B/bin/meshplan" "$B/tests/"* || true
fi
# What the tests and the check read: kernel sources are compiled in (include_str!);
# the models for the PyTorch baseline's workload.
mkdir -p "$B/models"
cp models/gpt2-124m.yaml "$B/models/"
git rev-parse HEAD >"$B/COMMIT" 2>/dev/null || true

size=$(du -sh "$B" | cut -f1)
bytes=$(du -sb "$B" | cut -f1)
echo "gpu-bundle: $B ($size):"
ls -l "$B/bin" "$B/tests"
if [ "$bytes" -gt $((60 * 1024 * 1024)) ]; then
    echo "gpu-bundle: warning: over 60 MB" >&2
fi
