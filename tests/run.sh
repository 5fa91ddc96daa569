#!/usr/bin/env bash
# Install the package into one fresh virtualenv per supported transformers release and run the test suite in each:
# the newest 5.x that installs (5.25.0, with kernels 0.19.1 from the registry), 5.23.0 (the
# last release that passes the cache as `past_key_values`) and 4.57 (the parent release targets 4.56). CPU torch
# 2.13.0, no network at test time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
for transformers in 5.25.0 5.23.0 4.57.6; do
    venv=".venv-tests/transformers-$transformers"
    if [ ! -x "$venv/bin/python" ]; then
        "$PY" -m venv "$venv"
    fi
    "$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0
    "$venv/bin/pip" install -q --disable-pip-version-check -e ".[test]" "transformers==$transformers"
    echo "== tests with transformers $transformers"
    HF_HUB_OFFLINE=1 "$venv/bin/python" -m pytest "$@"
done
