"""The pack on a real ComfyUI server: registration, every API workflow through the client, bad input."""

import importlib.util
import json
import urllib.request

import pytest
import tome_client
import ui_workflows

from tome_harness.comfyui import PACK_NAME, ROOT

WORKFLOWS = ROOT / "workflows" / "api"
SD15_WORKFLOWS = sorted(p.name for p in WORKFLOWS.glob("sd15_*.json"))
SMALL = ["--width", "64", "--height", "64", "--steps", "2"]


def _get_json(url):
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def test_ui_workflows_are_up_to_date_with_their_api_twins(server):
    """Regenerate with ``python scripts/ui_workflows.py`` after editing a graph in workflows/api/."""
    node_defs = _get_json(f"{server}/object_info")
    for api_path in sorted(WORKFLOWS.glob("*.json")):
        committed = json.loads((ui_workflows.WORKFLOWS / api_path.name).read_text())
        assert committed == ui_workflows.api_to_ui(json.loads(api_path.read_text()), node_defs), api_path.name


TOME_INPUTS = {"model", "ratio", "stride_x", "stride_y", "max_downsample"}
DIT_SCOPE_INPUTS = {"dit_scope", "skip_first_blocks", "skip_last_blocks"}
NODE_INPUTS = {
    "ApplyToMe": TOME_INPUTS,
    "ApplyToMeAdvanced": TOME_INPUTS | {"seed", "use_rand", "merge", "start_percent", "end_percent", "scope",
                                        "reuse_steps", "token_cache", "share_matching"} | DIT_SCOPE_INPUTS,
    "ApplyToDo": {"model", "downsample_factor", "max_downsample", "method", "start_percent", "end_percent",
                  "time_factor"} | DIT_SCOPE_INPUTS,
}


@pytest.mark.parametrize("node", NODE_INPUTS)
def test_object_info_lists_every_input_with_a_tooltip(server, node):
    info = _get_json(f"{server}/object_info/{node}")[node]
    inputs = {**info["input"]["required"], **info["input"].get("optional", {})}
    expected = NODE_INPUTS[node]
    assert set(inputs) == expected
    for name, spec in inputs.items():
        assert spec[1].get("tooltip"), f"{node}.{name} has no tooltip"
    assert info["category"] == "model_patches/unet" and info["description"]


@pytest.mark.parametrize("workflow", SD15_WORKFLOWS)
def test_every_sd15_api_workflow_runs_and_saves_an_image(server, workflow, tmp_path, capsys):
    status = tome_client.main([str(WORKFLOWS / workflow), "--server", server, "--out", str(tmp_path), *SMALL])
    assert status == 0, capsys.readouterr().err
    images = list(tmp_path.glob("*.png"))
    assert images and all(p.stat().st_size > 0 for p in images)


def test_ab_mode_prints_both_times_and_the_difference(server, tmp_path, capsys):
    status = tome_client.main([str(WORKFLOWS / "sd15_tome.json"), "--server", server, "--out", str(tmp_path),
                               "--ab", *SMALL])
    out = capsys.readouterr().out
    assert status == 0
    assert "| without ToMe |" in out and "| with ToMe |" in out and "PSNR" in out
    assert list((tmp_path / "without_tome").glob("*.png")) and list((tmp_path / "with_tome").glob("*.png"))


def test_out_of_range_ratio_is_rejected_naming_the_input_and_the_server_keeps_serving(server, tmp_path, capsys):
    """The server's own check (the client's --ratio check would stop it first, so the graph carries it)."""
    graph = json.loads((WORKFLOWS / "sd15_tome.json").read_text())
    graph["2"]["inputs"]["ratio"] = 1.5
    path = tmp_path / "out_of_range.json"
    path.write_text(json.dumps(graph))
    status = tome_client.main([str(path), "--server", server, "--out", str(tmp_path), *SMALL])
    err = capsys.readouterr().err
    assert status == tome_client.EXIT_REJECTED
    assert "ratio" in err and "HTTP 400" in err
    assert tome_client.main([str(WORKFLOWS / "sd15_tome.json"), "--server", server, "--out", str(tmp_path),
                             *SMALL]) == 0


def test_a_failing_execution_is_reported(server, tmp_path, capsys):
    graph = json.loads((WORKFLOWS / "sd15_tome.json").read_text())
    graph["2"] = {"class_type": "ApplyToMeAdvanced", "inputs": {
        **graph["2"]["inputs"], "seed": 0, "use_rand": True, "merge": "q, k and v",
        "start_percent": 0.9, "end_percent": 0.1}}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(graph))
    status = tome_client.main([str(path), "--server", server, "--out", str(tmp_path), *SMALL])
    assert status == tome_client.EXIT_FAILED
    assert "start_percent (0.9) must not be greater than end_percent (0.1)" in capsys.readouterr().err


def test_an_unreachable_server_is_reported(tmp_path, capsys):
    from tome_harness import server as comfyui_server

    url = f"http://127.0.0.1:{comfyui_server.free_port()}"
    assert tome_client.main([str(WORKFLOWS / "sd15_tome.json"), "--server", url, "--out", str(tmp_path)]) == \
        tome_client.EXIT_UNREACHABLE
    assert "cannot reach ComfyUI" in capsys.readouterr().err


def test_an_api_graph_saved_before_the_optional_inputs_existed_still_runs(server, tmp_path, capsys):
    """Apply ToMe (Advanced) with its required inputs only (no scope, no reuse_steps), as graphs saved with
    the V1 nodes were: the V3 nodes validate and run it."""
    graph = json.loads((WORKFLOWS / "sd15_tome.json").read_text())
    graph["2"] = {"class_type": "ApplyToMeAdvanced", "inputs": {
        **graph["2"]["inputs"], "seed": 0, "use_rand": True, "merge": "q, k and v",
        "start_percent": 0.0, "end_percent": 1.0}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(graph))
    assert tome_client.main([str(path), "--server", server, "--out", str(tmp_path), *SMALL]) == 0, \
        capsys.readouterr().err


def test_the_pack_registers_through_the_v3_entry_point_only():
    """A module exporting NODE_CLASS_MAPPINGS beside comfy_entrypoint would get its V1 nodes registered; the one
    other name ComfyUI reads there is WEB_DIRECTORY (the help pages)."""
    spec = importlib.util.spec_from_file_location("tome_pack_root", ROOT / "__init__.py",
                                                  submodule_search_locations=[str(ROOT)])
    package = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(package)
    assert callable(package.comfy_entrypoint)
    assert {name for name in vars(package) if not name.startswith("_")} == {"comfy_entrypoint", "WEB_DIRECTORY"}


@pytest.mark.parametrize("node", NODE_INPUTS)
def test_the_server_serves_each_nodes_help_page_where_the_help_panel_looks(server, node):
    """The frontend asks /extensions/<pack folder>/docs/<node id>.md (after a locale variant, <node id>/en.md).
    The page names every input of the node."""
    page = (ROOT / "web" / "docs" / f"{node}.md").read_text()
    with urllib.request.urlopen(f"{server}/extensions/{PACK_NAME}/docs/{node}.md", timeout=30) as response:
        assert response.read().decode() == page
    assert [name for name in sorted(NODE_INPUTS[node]) if f"`{name}`" not in page] == []
