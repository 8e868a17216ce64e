#!/usr/bin/env bash
# The Python package end to end: `pip install ./python` (maturin builds the PyO3
# extension with cargo, abi3 for CPython >= 3.9) into a pinned venv, then pytest:
# every function against the command line's own output (same numbers, same errors),
# typed results, pandas, Jupyter display, and a notebook-style smoke test.
#
#   tests/python/package/run.sh            # build, install, test
#   tests/python/package/run.sh -k compare # pytest arguments pass through
#
# The build shares the workspace's target folder (CARGO_TARGET_DIR), so crates the
# CPU suite already compiled in release are reused.
set -euo pipefail
cd "$(dirname "$0")/../../.."
root=$(pwd)
py=$(scripts/pyvenv.sh tests/python/package/requirements.txt)
export PATH="$(dirname "$py"):$PATH"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
"$py" -m pip install --quiet --disable-pip-version-check --no-build-isolation --force-reinstall --no-deps ./python
export PYTHONDONTWRITEBYTECODE=1
# Run from outside the repository so `import meshplan` is the installed package.
cd "$root/target"
exec "$py" -m pytest -q -p no:cacheprovider "$root/tests/python/package" "$@"
