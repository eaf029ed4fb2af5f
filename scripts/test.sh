#!/usr/bin/env bash
# The test suite, set-up included: bash scripts/test.sh [--full] [pytest arguments]
# Default: every test but those marked slow; --full: all of them (what CI runs, via .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
selection=(-m "not slow")
args=()
for arg in "$@"; do
    if [ "$arg" = --full ]; then selection=(); else args+=("$arg"); fi
done
bash scripts/setup.sh
exec .venv/bin/python -m pytest "${selection[@]}" "${args[@]}"
