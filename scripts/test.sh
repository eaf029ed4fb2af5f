#!/usr/bin/env bash
# The test suite, set-up included: bash scripts/test.sh [--full] [pytest arguments]
# Default: every test but those marked slow; --full: all of them (what CI runs, via .ci/run). Both on two
# pytest-xdist workers (-n 0 as an argument runs in one process), the tests sharing a ComfyUI kept together.
set -euo pipefail
cd "$(dirname "$0")/.."
selection=(-m "not slow")
args=()
for arg in "$@"; do
    if [ "$arg" = --full ]; then selection=(); else args+=("$arg"); fi
done
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n 2 --dist loadgroup "${selection[@]}" "${args[@]}"
