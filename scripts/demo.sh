#!/usr/bin/env bash
# The main job, set-up included: ComfyUI headless with this pack, A/B through the client, a timing table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
