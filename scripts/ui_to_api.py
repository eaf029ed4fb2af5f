"""Convert a UI-format workflow (what ComfyUI's "Save" writes) to the API format ``POST /prompt`` takes.

It follows ComfyUI's page (frontend 1.32, ``graphToPrompt`` and ``ExecutableNodeDTO``) with the node
definitions a server lists at ``/object_info``:

- each node's ``widgets_values`` hold one value per widget input, in the order the node declares its
  inputs (``input_order``), plus the values of the page's own "control after generate" widgets (one after a
  seed-like INT, two after a COMBO), which are never sent;
- links are followed through Reroute nodes; a PrimitiveNode gives its value to the widget it feeds;
- muted (mode 2) and bypassed (mode 4) nodes are dropped; a bypassed node's consumers take the bypassed
  node's input of the matching type instead, and inputs left pointing at a dropped node are removed;
- ``{a|b}`` choices and comments in dynamic-prompt text are resolved, as the page does when it queues.

The reverse, API to UI, is ``ui_workflows.api_to_ui``. Standard library only.
"""

from __future__ import annotations

import random
import re

MUTED, BYPASSED = 2, 4
# Nodes that live only in the page: they never reach the server and /object_info does not list them.
REROUTE, PRIMITIVE = "Reroute", "PrimitiveNode"
VIRTUAL_NODES = {REROUTE, PRIMITIVE, "Note", "MarkdownNote"}
# Input types the page draws as widgets (its ComfyWidgets table); every other type is a link-only socket.
WIDGET_TYPES = {"INT", "FLOAT", "BOOLEAN", "STRING", "COMBO", "MARKDOWN", "IMAGEUPLOAD", "COLOR",
                "IMAGECOMPARE", "CHART", "GALLERIA", "TEXTAREA"}
# The page adds a "control after generate" widget to INT inputs with these names unless told otherwise.
SEED_NAMES = {"seed", "noise_seed"}
COMMENTS = re.compile(r"/\*[\s\S]*?\*/|//.*")
ESCAPED = re.compile(r"\\([{}|])")


class ConversionError(ValueError):
    """The workflow cannot be converted; the message names the node and what to do."""


def is_ui_workflow(data) -> bool:
    return isinstance(data, dict) and isinstance(data.get("nodes"), list) and "links" in data


def is_api_workflow(data) -> bool:
    return isinstance(data, dict) and bool(data) and all(
        isinstance(node, dict) and "class_type" in node and isinstance(node.get("inputs"), dict)
        for node in data.values())


def ordered_inputs(node_def: dict) -> list[tuple[str, list]]:
    """The node's inputs in the order the page creates their widgets: ``input_order`` (required, then
    optional) where the server sends it, else the declaration order."""
    declared = node_def["input"]
    sections = [declared.get("required", {}), declared.get("optional", {})]
    order = node_def.get("input_order", {})
    ordered = [(name, section[name]) for key, section in zip(("required", "optional"), sections, strict=True)
               for name in order.get(key, []) if name in section]
    seen = {name for name, _ in ordered}
    return ordered + [(name, spec) for section in sections for name, spec in section.items() if name not in seen]


def widget_kind(spec: list) -> str | None:
    """The widget type the page draws for an input spec, or None for a link-only socket."""
    options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    kind = "COMBO" if isinstance(spec[0], list) else options.get("widgetType", spec[0])
    return kind if kind in WIDGET_TYPES and not options.get("forceInput") else None


def control_widget_count(name: str, spec: list, kind: str) -> int:
    """How many page-only values follow this widget in ``widgets_values``: "control after generate" (and,
    for a COMBO, its filter list)."""
    options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    control = options.get("control_after_generate")
    if kind == "INT":
        return 1 if (name in SEED_NAMES if control is None else control) else 0
    return 2 if kind == "COMBO" and control else 0


def widget_names(node_def: dict) -> list[str | None]:
    """The input each ``widgets_values`` entry belongs to, None for the page-only control values."""
    names: list[str | None] = []
    for name, spec in ordered_inputs(node_def):
        kind = widget_kind(spec)
        if kind is not None:
            names += [name] + [None] * control_widget_count(name, spec, kind)
    return names


def widget_inputs(node: dict, node_def: dict, rng: random.Random) -> dict:
    """The API inputs that come from the node's widgets."""
    values = node.get("widgets_values") or []
    if isinstance(values, dict):  # some packs save widgets by name
        pairs = [(name, values[name]) for name in widget_names(node_def) if name in values]
    else:
        pairs = [(name, value) for name, value in zip(widget_names(node_def), values, strict=False) if name]
    dynamic = {name for name, spec in ordered_inputs(node_def)
               if len(spec) > 1 and isinstance(spec[1], dict) and spec[1].get("dynamicPrompts")}
    inputs = {}
    for name, value in pairs:
        if name in dynamic and isinstance(value, str):
            value = resolve_dynamic_prompt(value, rng)
        # A list would read as a link, so the page boxes list values; the server unboxes them.
        inputs[name] = {"__value__": value} if isinstance(value, list) else value
    return inputs


def resolve_dynamic_prompt(text: str, rng: random.Random) -> str:
    """Strip C-style comments and replace each ``{a|b|...}`` by one of its choices (``\\`` escapes a
    brace or bar); a nested block is resolved once its outer choice is drawn, as in the page."""
    text = COMMENTS.sub("", text)
    result, i = "", 0
    while i < len(text):
        char, i = text[i], i + 1
        if char == "\\":
            result, i = result + "\\" + text[i:i + 1], i + 1
        elif char == "{":
            choice, i = choice_block(text, i, rng)
            result += choice
        else:
            result += char
    return ESCAPED.sub(r"\1", result)


def choice_block(text: str, i: int, rng: random.Random) -> tuple[str, int]:
    """The resolved choice of the block that opens before ``text[i]``, and the index after its ``}``."""
    options, current, depth = [], "", 0
    while i < len(text):
        char, i = text[i], i + 1
        if char == "\\":
            current, i = current + "\\" + text[i:i + 1], i + 1
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            if not depth:
                break
            depth -= 1
        elif char == "|" and not depth:
            options.append(current)
            current = ""
            continue
        current += char
    options.append(current)
    return resolve_dynamic_prompt(rng.choice(options), rng), i


def is_valid_connection(first, second) -> bool:
    """The page's type check: wildcards match anything, "A,B" lists match any member."""
    first, second = ("" if t in ("*", 0, None) else str(t).lower() for t in (first, second))
    if not first or not second or first == second:
        return True
    return any(a == b for a in first.split(",") for b in second.split(","))


class UiGraph:
    """A UI-format graph with the page's link resolution."""

    def __init__(self, workflow: dict):
        self.nodes = {str(node["id"]): node for node in workflow["nodes"]}
        self.links = {}
        for link in workflow["links"]:
            if isinstance(link, dict):  # schema version 1 writes objects, 0.4 writes arrays
                link = [link["id"], link["origin_id"], link["origin_slot"], link["target_id"],
                        link["target_slot"], link.get("type")]
            self.links[link[0]] = (str(link[1]), link[2])

    def resolve_input(self, node: dict, slot: int, target_type=None, seen: frozenset = frozenset()):
        """What input ``slot`` of ``node`` receives: ``("link", node_id, output_slot)``,
        ``("value", value)`` from a PrimitiveNode, or None (nothing, the widget value stays)."""
        key = (str(node["id"]), "input", slot)
        if key in seen:
            raise ConversionError(f"node {node['id']} ({node['type']}): its links form a loop through "
                                  "bypassed or reroute nodes; remove the loop in ComfyUI")
        socket = node["inputs"][slot]
        if socket.get("link") is None:
            return None
        origin_id, origin_slot = self.links.get(socket["link"], (None, None))
        if origin_id not in self.nodes:
            raise ConversionError(f"node {node['id']} ({node['type']}): input {socket.get('name')} refers to "
                                  f"link {socket['link']}, which leads to no node in the file: reconnect it in "
                                  "ComfyUI and save again")
        return self.resolve_output(self.nodes[origin_id], origin_slot, target_type or socket.get("type"),
                                   seen | {key})

    def resolve_output(self, node: dict, slot: int, target_type, seen: frozenset):
        """Where output ``slot`` of ``node`` really comes from, seen by an input of ``target_type``."""
        if node.get("mode") == BYPASSED:
            matching = self.bypass_input(node, slot, target_type)
            return None if matching is None else self.resolve_input(node, matching, None, seen)
        if node["type"] == PRIMITIVE:
            return "value", (node.get("widgets_values") or [None])[0]
        if node["type"] == REROUTE:
            return self.resolve_input(node, slot, target_type, seen) if node.get("inputs") else None
        return "link", str(node["id"]), slot

    @staticmethod
    def bypass_input(node: dict, slot: int, target_type) -> int | None:
        """The input a bypassed node passes on for output ``slot``: the same slot when its type fits, else
        the first input of exactly ``target_type``, else the first that fits (the page's order)."""
        inputs = node.get("inputs") or []
        if target_type in ("*", "", None):
            return (slot if slot < len(inputs) else 0) if inputs else None
        output_type = node["outputs"][slot].get("type")
        fits = [i for i, socket in enumerate(inputs)
                if is_valid_connection(socket.get("type"), output_type)
                and is_valid_connection(socket.get("type"), target_type)]
        exact = [i for i, socket in enumerate(inputs) if socket.get("type") == target_type]
        for candidate in ([slot] if slot in fits else []) + exact + fits:
            return candidate
        return None


def ui_to_api(workflow: dict, node_defs: dict, rng: random.Random | None = None) -> dict:
    """The API-format graph ComfyUI's page would queue for this UI-format workflow.

    ``node_defs`` is the server's ``/object_info``; ``rng`` draws the ``{a|b}`` choices (a fixed seed by
    default, so the same file gives the same graph).
    """
    rng = rng or random.Random(0)
    subgraphs = {sub.get("id") for sub in (workflow.get("definitions") or {}).get("subgraphs", [])}
    graph = UiGraph(workflow)
    api = {}
    for node_id, node in graph.nodes.items():
        if node.get("mode") in (MUTED, BYPASSED) or node["type"] in VIRTUAL_NODES:
            continue
        if node["type"] in subgraphs:
            raise ConversionError(f"node {node_id} is a subgraph, which this client does not expand: "
                                  "export the workflow with ComfyUI's Save (API) instead")
        if node["type"] not in node_defs:
            raise ConversionError(f"node {node_id} ({node['type']}) is unknown to the server: install the "
                                  "custom node pack that provides it there, or remove the node")
        inputs = widget_inputs(node, node_defs[node["type"]], rng)
        for slot, socket in enumerate(node.get("inputs") or []):
            resolved = graph.resolve_input(node, slot)
            if resolved is None:
                continue
            inputs[socket["name"]] = list(resolved[1:]) if resolved[0] == "link" else resolved[1]
        api[node_id] = {"class_type": node["type"], "inputs": inputs}
    for node in api.values():  # as the page does: drop inputs that point at muted nodes
        node["inputs"] = {name: value for name, value in node["inputs"].items()
                          if not (isinstance(value, list) and len(value) == 2 and value[0] not in api)}
    return api
