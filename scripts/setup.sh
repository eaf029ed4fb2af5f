#!/usr/bin/env bash
# Set up everything on a fresh machine; safe to run again (it skips what is done).
#  - .venv/ with the pinned requirements (torch 2.13.0, CPU build, from this machine's disk), and this
#    repository's tome/ and tome_harness/ packages installed in editable mode;
#  - .venv-tools/ with comfy-cli (requirements/tools.txt), for `comfy node validate` and the registry's packer:
#    its own environment, since it pulls in packages the test host does not need;
#  - a ComfyUI 0.3.75 host in .comfyui/, unless COMFYUI_PATH names your own ComfyUI;
#  - Debian's chromium, for the browser tests (Playwright drives it; it cannot download a browser here), and
#    mate-backgrounds, the photographs of the quality bench.
set -euo pipefail
cd "$(dirname "$0")/.."

# A virtual environment VENV holding the pinned REQUIREMENTS; reinstalled only when that file changes (its hash is
# kept in the environment). --no-compile: byte-compiling every installed module (torch's thousands) took half of
# the install; Python compiles what it imports, when it first imports it.
install_requirements() {
    local venv=$1 requirements=$2 stamp=$1/.requirements.sha256 wanted
    if [ ! -x "$venv/bin/python" ]; then
        "${PYTHON:-python3}" -m venv "$venv"
    fi
    wanted=$(sha256sum "$requirements" | cut -d' ' -f1)
    if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile -r "$requirements" \
            2> >(grep -v "^WARNING: Location" >&2)
        echo "$wanted" > "$stamp"
    fi
}

# comfy-cli's environment in the background meanwhile (pip is single-threaded; this machine has 2 cores).
install_requirements .venv-tools requirements/tools.txt &
tools=$!
install_requirements .venv requirements/dev.txt
# tome/ and the test harness (tome_harness/), importable from the venv: editable, so edits need no reinstall.
# Checked in isolated mode (-I), where this folder is not on the path, and against this checkout.
if ! .venv/bin/python -I -c 'import pathlib, sys, tome_harness
sys.exit(pathlib.Path(tome_harness.__file__).resolve().parents[1] != pathlib.Path(sys.argv[1]).resolve())' "$PWD" \
        2> /dev/null; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e . 2> >(grep -v "^WARNING: Location" >&2)
fi

if [ -n "${COMFYUI_PATH:-}" ]; then
    echo "Using your ComfyUI at $COMFYUI_PATH"
else
    .venv/bin/python scripts/provision_comfyui.py .comfyui
fi

# Debian's packages: chromium for the browser tests, mate-backgrounds for the quality bench's photographs
# (tome_harness/photos.py: real photographs, installed, never committed).
debian_packages=()
command -v chromium > /dev/null || debian_packages+=(chromium)
[ -d /usr/share/backgrounds/mate/nature ] || debian_packages+=(mate-backgrounds)
if [ ${#debian_packages[@]} -gt 0 ]; then
    sudo=$([ "$(id -u)" = 0 ] || echo sudo)
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${debian_packages[@]}" \
        > /dev/null
fi

wait "$tools"  # its failure fails the set-up
