"""The pack as the Comfy Registry sees it: pyproject.toml's fields, `comfy node validate`, the published archive.

comfy-cli lives in .venv-tools/ (scripts/setup.sh), apart from the test host's environment.
"""

import json
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".venv-tools" / "bin"
READ_CONFIG = """import dataclasses, json
from comfy_cli.registry.config_parser import extract_node_configuration
print(json.dumps(dataclasses.asdict(extract_node_configuration("pyproject.toml"))))"""


@pytest.fixture(scope="module")
def tools():
    assert (TOOLS / "comfy").exists(), "comfy-cli is missing: run scripts/setup.sh"
    return TOOLS


def test_pyproject_has_what_the_registry_reads(tools):
    """As comfy-cli's parser reads it."""
    config = json.loads(subprocess.run([str(tools / "python"), "-c", READ_CONFIG], cwd=ROOT, check=True,
                                       capture_output=True, text=True, timeout=120).stdout)
    project, comfy = config["project"], config["tool_comfy"]
    assert "comfyui" not in project["name"].lower()
    assert re.fullmatch(r"[a-z][a-z0-9]*(?:[-_.][a-z0-9]+)*", project["name"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"]) and project["description"]
    assert (ROOT / project["license"]["file"]).exists()
    assert all(project["urls"][key] for key in ("repository", "documentation", "issues"))
    assert project["supported_os"] and project["supported_accelerators"]
    assert project["supported_comfyui_version"].startswith(">=")
    assert comfy["publisher_id"] and comfy["display_name"]
    # The icon is served from this repository's main branch: the file must be committed there.
    raw = project["urls"]["repository"].replace("https://github.com/", "https://raw.githubusercontent.com/")
    assert comfy["icon"].startswith(raw + "/main/")
    assert (ROOT / comfy["icon"].removeprefix(raw + "/main/")).exists()


def test_comfy_node_validate_runs_clean(tools):
    result = subprocess.run([str(tools / "comfy"), "--skip-prompt", "--no-enable-telemetry", "node", "validate"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    output = result.stdout + result.stderr  # rich writes some of it to stderr
    assert result.returncode == 0, output
    assert "All validation checks passed" in output and "warning" not in output.lower(), output


def test_the_published_archive_holds_the_pack_and_leaves_out_the_harness(tools, tmp_path):
    """Packed by comfy-cli's own packer (what `comfy node pack` and `publish` upload): the git-tracked files
    less .comfyignore's patterns."""
    archive = tmp_path / "node.zip"
    subprocess.run([str(tools / "python"), "-c", "import sys; from comfy_cli.file_utils import zip_files; "
                    "zip_files(sys.argv[1])", str(archive)], cwd=ROOT, check=True, capture_output=True, timeout=300)
    names = set(zipfile.ZipFile(archive).namelist())
    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True,
                                 text=True).stdout.split())
    shipped = {name for name in tracked if name.split("/")[0] in {"tome", "web", "workflows", "docs"}}
    assert shipped | {"__init__.py", "nodes.py", "pyproject.toml", "README.md", "LICENSE",
                      "scripts/tome_client.py", "scripts/ui_to_api.py"} <= names
    left_out = ("tests/", "bench/", "tome_harness/", "requirements/", ".ci/", ".github/")
    assert [name for name in names if name.startswith(left_out)] == []
    assert sorted(name for name in names if name.startswith("scripts/")) == ["scripts/tome_client.py",
                                                                             "scripts/ui_to_api.py"]
