"""The UI-format twins of the API workflows: made from them, and read back into them.

ComfyUI's window opens UI-format graphs (nodes with positions, widget values in
the order the node declares its inputs, links as a table), while ``POST /prompt``
takes the API format. We write each example graph once, in the API format
(``workflows/api/``), and generate its UI twin into ``workflows/`` with the
node definitions a running ComfyUI serves at ``/object_info``:

    python scripts/ui_workflows.py --server http://127.0.0.1:8188

(or with no ``--server``, which starts a headless ComfyUI with this pack for the
time it takes). The browser test checks that each twin, loaded into ComfyUI's
page, queues exactly its API graph.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import urllib.request
from pathlib import Path

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows"
COLUMN_WIDTH, ROW_HEIGHT, NODE_WIDTH = 380, 300, 330


def declared_inputs(node_def: dict) -> list[tuple[str, list]]:
    """The node's inputs in the order the UI lays out their widgets and slots: required, then optional."""
    inputs = node_def["input"]
    return [*inputs.get("required", {}).items(), *inputs.get("optional", {}).items()]


def widget_values(node_def: dict, api_inputs: dict) -> list:
    """The node's ``widgets_values``: one per widget input, plus the "control after generate" value the UI
    keeps after a seed widget."""
    values = []
    for name, spec in declared_inputs(node_def):
        if name not in api_inputs or is_link(api_inputs[name]):
            continue
        values.append(api_inputs[name])
        if len(spec) > 1 and spec[1].get("control_after_generate"):
            values.append("fixed")
    return values


def is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[1], int)


def depths(api_graph: dict) -> dict[str, int]:
    """How many links lie between each node and the graph's sources: the column the node is drawn in."""
    memo: dict[str, int] = {}

    def depth(node_id: str) -> int:
        if node_id not in memo:
            parents = [value[0] for value in api_graph[node_id]["inputs"].values() if is_link(value)]
            memo[node_id] = 1 + max(map(depth, parents), default=-1)
        return memo[node_id]

    return {node_id: depth(node_id) for node_id in api_graph}


def api_to_ui(api_graph: dict, node_defs: dict) -> dict:
    """The UI-format graph of an API-format one (node ids must be integers, as ComfyUI's API graphs use)."""
    column = depths(api_graph)
    rows: dict[int, int] = {}
    nodes, links = {}, []
    for order, node_id in enumerate(sorted(api_graph, key=lambda n: (column[n], int(n)))):
        node, node_def = api_graph[node_id], node_defs[api_graph[node_id]["class_type"]]
        outputs = zip(node_def["output_name"], node_def["output"], strict=True)
        row = rows[column[node_id]] = rows.get(column[node_id], -1) + 1
        nodes[node_id] = {
            "id": int(node_id), "type": node["class_type"],
            "pos": [column[node_id] * COLUMN_WIDTH, row * ROW_HEIGHT], "size": [NODE_WIDTH, 130],
            "flags": {}, "order": order, "mode": 0, "inputs": [],
            "outputs": [{"name": name, "type": kind, "links": [], "slot_index": slot}
                        for slot, (name, kind) in enumerate(outputs)],
            "properties": {"Node name for S&R": node["class_type"]},
            "widgets_values": widget_values(node_def, node["inputs"]),
        }
    for node_id, node in api_graph.items():
        for name, _ in declared_inputs(node_defs[node["class_type"]]):
            value = node["inputs"].get(name)
            if not is_link(value):
                continue
            source, slot = value
            link_id = len(links) + 1
            kind = nodes[source]["outputs"][slot]["type"]
            links.append([link_id, int(source), slot, int(node_id), len(nodes[node_id]["inputs"]), kind])
            nodes[node_id]["inputs"].append({"name": name, "type": kind, "link": link_id})
            nodes[source]["outputs"][slot]["links"].append(link_id)
    return {"last_node_id": max(map(int, api_graph)), "last_link_id": len(links),
            "nodes": sorted(nodes.values(), key=lambda n: n["id"]), "links": links,
            "groups": [], "config": {}, "extra": {}, "version": 0.4}


def fetch_node_defs(server: str) -> dict:
    with urllib.request.urlopen(f"{server}/object_info", timeout=60) as response:
        return json.load(response)


def write_ui_workflows(node_defs: dict) -> list[Path]:
    written = []
    for api_path in sorted((WORKFLOWS / "api").glob("*.json")):
        ui_path = WORKFLOWS / api_path.name
        ui_path.write_text(json.dumps(api_to_ui(json.loads(api_path.read_text()), node_defs), indent=2) + "\n")
        written.append(ui_path)
    return written


@contextlib.contextmanager
def server_address(server: str | None):
    if server:
        yield server
        return
    from tome_harness import server as comfyui_server

    with tempfile.TemporaryDirectory() as workdir:
        with comfyui_server.running_server(Path(workdir), Path(workdir) / "checkpoints") as url:
            yield url


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", help="a running ComfyUI with this pack (default: start one)")
    args = parser.parse_args(argv)
    with server_address(args.server) as server:
        for path in write_ui_workflows(fetch_node_defs(server)):
            print(path)


if __name__ == "__main__":
    main()
