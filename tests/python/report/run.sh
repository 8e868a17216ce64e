#!/usr/bin/env bash
# The browser test of `meshplan report`: Debian's chromium, headless, driven by
# Playwright from a pinned venv (scripts/pyvenv.sh). Playwright's own browser
# download is never used.
#
#   tests/python/report/run.sh [PYTEST ARGS...]
#
# MESHPLAN_BIN: the binary to test (default target/release/meshplan, built if
# missing). As root without /usr/bin/chromium it installs Debian's `chromium`; when
# that is impossible the browser tests skip, saying why (the file checks still run).
# Writes target/test-artifacts/report.png (and report-schedule.png).
set -euo pipefail
cd "$(dirname "$0")/../../.."

chromium=${CHROMIUM:-/usr/bin/chromium}
if [ ! -x "$chromium" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "tests/python/report: installing Debian's chromium" >&2
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >&2; then
            echo "tests/python/report: apt-get could not install chromium" >&2
        fi
    else
        echo "tests/python/report: no $chromium, and not root with apt-get to install it" >&2
    fi
fi

bin=${MESHPLAN_BIN:-target/release/meshplan}
if [ ! -x "$bin" ]; then
    cargo build --release --bin meshplan
fi
py=$(scripts/pyvenv.sh tests/python/report/requirements.txt)
MESHPLAN_BIN=$bin CHROMIUM=$chromium exec "$py" -m pytest -rs -s -p no:cacheprovider tests/python/report "$@"
