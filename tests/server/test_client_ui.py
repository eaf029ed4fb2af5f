"""UI-format workflows converted to the API format with a real server's /object_info, as ComfyUI's page does."""

import copy
import json
import random
import urllib.request

import pytest
import tome_client
import ui_to_api

from tome_harness.comfyui import ROOT

WORKFLOWS = ROOT / "workflows"
UI_WORKFLOWS = sorted(p.name for p in WORKFLOWS.glob("*.json"))
SMALL = ["--width", "64", "--height", "64", "--steps", "2"]


@pytest.fixture(scope="module")
def node_defs(server):
    with urllib.request.urlopen(f"{server}/object_info", timeout=60) as response:
        return json.load(response)


def _ui(name="sd15_tome.json"):
    return json.loads((WORKFLOWS / name).read_text())


def _api(name="sd15_tome.json"):
    return json.loads((WORKFLOWS / "api" / name).read_text())


def _node(ui, node_id):
    return next(node for node in ui["nodes"] if node["id"] == node_id)


def _connect(ui, origin, origin_slot, target, input_name, kind):
    """Link ``origin``'s output to ``target``'s input (added as a socket when it is a widget)."""
    link_id = max(link[0] for link in ui["links"]) + 1
    inputs = _node(ui, target)["inputs"]
    socket = next((s for s in inputs if s["name"] == input_name), None)
    if socket is None:
        socket = {"name": input_name, "type": kind, "widget": {"name": input_name}, "link": None}
        inputs.append(socket)
    ui["links"] = [link for link in ui["links"] if link[0] != socket["link"]]
    socket["link"] = link_id
    ui["links"].append([link_id, origin, origin_slot, target, inputs.index(socket), kind])
    _node(ui, origin)["outputs"][origin_slot]["links"].append(link_id)


@pytest.mark.parametrize("name", UI_WORKFLOWS)
def test_every_shipped_ui_workflow_converts_to_its_api_twin(node_defs, name):
    assert ui_to_api.ui_to_api(_ui(name), node_defs) == _api(name)


def test_a_bypassed_node_hands_its_matching_input_to_its_consumers(node_defs):
    ui = _ui()
    _node(ui, 2)["mode"] = ui_to_api.BYPASSED  # Apply ToMe: the KSampler takes the checkpoint's model
    expected = _api()
    del expected["2"]
    expected["6"]["inputs"]["model"] = ["1", 0]
    assert ui_to_api.ui_to_api(ui, node_defs) == expected


@pytest.mark.parametrize("node_id, consumer, lost_input", [(2, "6", "model"), (5, "6", "latent_image")])
def test_a_muted_node_or_a_bypassed_one_without_a_matching_input_leaves_its_consumer_input_unset(
        node_defs, node_id, consumer, lost_input):
    """As in the page: the server then names the missing input."""
    for mode in (ui_to_api.MUTED, ui_to_api.BYPASSED):
        ui = _ui()
        _node(ui, node_id)["mode"] = mode
        api = ui_to_api.ui_to_api(ui, node_defs)
        assert str(node_id) not in api
        if mode == ui_to_api.MUTED or node_id == 5:  # the latent has no input to pass on
            assert lost_input not in api[consumer]["inputs"]


def test_reroutes_are_followed_and_a_primitive_gives_its_value_to_the_widget_it_feeds(node_defs):
    ui = _ui()
    ui["nodes"] += [
        {"id": 20, "type": "Reroute", "mode": 0, "inputs": [{"name": "", "type": "*", "link": None}],
         "outputs": [{"name": "", "type": "MODEL", "links": []}], "properties": {}},
        {"id": 21, "type": "PrimitiveNode", "mode": 0, "inputs": [],
         "outputs": [{"name": "INT", "type": "INT", "links": [], "widget": {"name": "seed"}}],
         "widgets_values": [7, "fixed"]},
        {"id": 22, "type": "Note", "mode": 0, "widgets_values": ["a note"]},
    ]
    _connect(ui, 1, 0, 20, "", "MODEL")
    _connect(ui, 20, 0, 2, "model", "MODEL")
    _connect(ui, 21, 0, 6, "seed", "INT")
    expected = _api()
    expected["6"]["inputs"]["seed"] = 7
    assert ui_to_api.ui_to_api(ui, node_defs) == expected


def test_dynamic_prompts_are_resolved_and_control_values_are_never_sent(node_defs):
    ui = _ui()
    _node(ui, 3)["widgets_values"] = ["a {red|red} lighthouse // the page strips comments"]
    _node(ui, 6)["widgets_values"][1] = "randomize"  # control_after_generate: the page's own widget
    api = ui_to_api.ui_to_api(ui, node_defs)
    assert api["3"]["inputs"]["text"] == "a red lighthouse "
    assert api["6"]["inputs"] == _api()["6"]["inputs"]


@pytest.mark.parametrize("text, expected", [
    ("{a|{b|b}}", {"a", "b"}),
    (r"\{kept\} /* gone */", {"{kept} "}),
    ("{x|}", {"x", ""}),
])
def test_dynamic_prompt_choices(text, expected):
    rng = random.Random(0)
    assert {ui_to_api.resolve_dynamic_prompt(text, rng) for _ in range(50)} == expected


def test_a_ui_workflow_runs_through_the_client(server, tmp_path, capsys):
    status = tome_client.main([str(WORKFLOWS / "sd15_tome.json"), "--server", server, "--out", str(tmp_path),
                               *SMALL])
    assert status == 0, capsys.readouterr().err
    assert list(tmp_path.glob("*.png"))


def test_a_node_unknown_to_the_server_is_named(server, tmp_path, capsys):
    ui = copy.deepcopy(_ui())
    _node(ui, 2)["type"] = "SomeoneElsesNode"
    path = tmp_path / "unknown.json"
    path.write_text(json.dumps(ui))
    assert tome_client.main([str(path), "--server", server, "--out", str(tmp_path)]) == tome_client.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "node 2 (SomeoneElsesNode) is unknown to the server" in err and "Traceback" not in err
