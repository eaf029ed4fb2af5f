"""ComfyUI's own page, in headless Chromium, against the test server: the nodes and workflows as a user meets them.

Debian's chromium (installed by scripts/setup.sh) driven by Playwright; no
browser is downloaded. Set TOME_SCREENSHOT to a path to keep the screenshot
(the README's docs/comfyui_window.png is made that way).
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import ui_workflows

UI_WORKFLOWS = sorted(p.name for p in ui_workflows.WORKFLOWS.glob("*.json"))
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                  "--disable-background-networking", "--disable-component-update"]
MISSING_NODES = "This workflow has missing nodes"
pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def page(server):
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is missing: run scripts/setup.sh"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 2000, "height": 1000})
        page.goto(server)
        page.wait_for_function("window.app?.graph && window.LiteGraph", timeout=120_000)
        close_dialogs(page)  # a first visit opens the template browser
        yield page
        browser.close()


def close_dialogs(page):
    page.wait_for_timeout(1000)
    while page.locator(".p-dialog-mask").count():
        page.locator(".p-dialog-mask").first.click(position={"x": 5, "y": 5})
        page.wait_for_timeout(300)


def load(page, graph: dict) -> None:
    page.evaluate("graph => window.app.loadGraphData(graph)", graph)
    page.wait_for_timeout(1000)


def missing_nodes_dialog(page):
    return page.get_by_text(MISSING_NODES)


def test_template_browser_lists_every_ui_workflow(page):
    page.get_by_role("button", name="Templates").first.click()
    for name in UI_WORKFLOWS:
        page.get_by_text(Path(name).stem, exact=True).first.wait_for(timeout=30_000)
    close_dialogs(page)


def test_node_library_finds_every_node(page):
    page.get_by_role("button", name="Node Library (n)").click()
    search = page.get_by_placeholder("Search Nodes...")
    for query, display_name in [("Apply ToDo", "Apply ToDo (Token Downsampling)"),
                                ("Apply ToMe", "Apply ToMe (Advanced)"), ("Apply ToMe", "Apply ToMe")]:
        search.fill(query)
        page.locator(".p-tree").get_by_text(display_name, exact=True).wait_for(timeout=30_000)


def test_a_missing_node_is_reported(page):
    """The check the next test relies on: a graph with an unknown node does raise ComfyUI's warning."""
    graph = json.loads((ui_workflows.WORKFLOWS / "sd15_tome.json").read_text())
    next(node for node in graph["nodes"] if node["type"] == "ApplyToMe")["type"] = "NoSuchNode"
    load(page, graph)
    missing_nodes_dialog(page).wait_for(timeout=30_000)
    close_dialogs(page)


@pytest.mark.parametrize("workflow", UI_WORKFLOWS)
def test_ui_workflow_loads_without_missing_nodes_and_queues_its_api_twin(page, workflow):
    load(page, json.loads((ui_workflows.WORKFLOWS / workflow).read_text()))
    assert missing_nodes_dialog(page).count() == 0
    queued = page.evaluate("async () => (await window.app.graphToPrompt()).output")
    api = json.loads((ui_workflows.WORKFLOWS / "api" / workflow).read_text())
    assert {node_id: (node["class_type"], node["inputs"]) for node_id, node in queued.items()} == \
           {node_id: (node["class_type"], node["inputs"]) for node_id, node in api.items()}


def test_screenshot_of_the_ab_workflow(page, tmp_path):
    load(page, json.loads((ui_workflows.WORKFLOWS / "sd15_ab_tome.json").read_text()))
    # Readable: above the zoom where the canvas stops drawing text, right of the node library.
    page.evaluate("""() => {
        const ds = window.app.canvas.ds;
        ds.scale = 0.7;
        ds.offset = [480 / ds.scale, 200 / ds.scale];
        window.app.canvas.setDirty(true, true);
    }""")
    page.wait_for_timeout(500)
    path = Path(os.environ.get("TOME_SCREENSHOT") or tmp_path / "comfyui_window.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
