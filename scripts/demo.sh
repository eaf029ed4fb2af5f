#!/usr/bin/env bash
# The main job, set-up included: bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python bench/merge_bench.py "$@"
