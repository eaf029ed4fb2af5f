"""The GPU rule's table (``tome.hosts.gpu_rule.ROWS``) is the GPU tables': docs/BENCHMARKS.md "On a GPU (one
H200)" (the U-Net and DiT tables) and docs/SPEED_STACK.md "torch.compile on a GPU". Every setting the tables show
losing at some size has its row, with every size the tables measured it at and their figures, and no row holds
anything the tables do not; docs/SETTINGS.md "When the node warns on a GPU" quotes each row's figures.
"""

import re

from tome.hosts import gpu_rule as rule
from tome.hosts.dit_families import FLUX, HIDREAM, HUNYUAN_VIDEO, LTXV, LUMINA2, MOCHI, QWEN_IMAGE, SD3, WAN
from tome.hosts.dit_settings import SCOPE_ATTENTION, SCOPE_BLOCK
from tome_harness.comfyui import ROOT

# The tables' columns of the pack's settings (the core node's and the ideal-only ones are not the pack's), and
# their model names, as the rule reads them.
UNET_COLUMNS = {"Apply ToMe 0.5 (default)": rule.Setting(rule.TOME, rule.SELF_ATTENTION),
                "fast setting": rule.Setting(rule.TOME, rule.WIDER),
                "Apply ToDo 2": rule.Setting(rule.TODO, rule.SELF_ATTENTION)}
DIT_COLUMNS = {"ToDo 2 (attention)": rule.Setting(rule.TODO, SCOPE_ATTENTION),
               "ToMe 0.5 (attention)": rule.Setting(rule.TOME, SCOPE_ATTENTION),
               "block ToMe 0.5, skips 2:2 (ideal)": rule.Setting(rule.TOME, SCOPE_BLOCK),
               "block ToDo 2, skips 2:2": rule.Setting(rule.TODO, SCOPE_BLOCK)}
COMPILE_ROWS = {"Apply ToMe 0.5": rule.Setting(rule.TOME, SCOPE_ATTENTION),
                "Apply ToDo 2": rule.Setting(rule.TODO, SCOPE_ATTENTION),
                "Apply ToMe 0.5, block scope": rule.Setting(rule.TOME, SCOPE_BLOCK),
                "Apply ToDo 2, block scope": rule.Setting(rule.TODO, SCOPE_BLOCK)}
COMPILE_COLUMN = "compiled vs compiled none"
COMPILED_AT = ("SD3.5 medium", SD3, "1024 px")  # the compile table's model and size, as its heading line says
FAMILIES = {"SD1.5": rule.SD15, "SDXL": rule.SDXL, "Flux": FLUX, "SD3.5 medium": SD3, "Qwen-Image": QWEN_IMAGE,
            "Z-Image": LUMINA2, "HiDream I1": HIDREAM, "Wan 2.1 1.3B": WAN, "Wan 2.1 14B": WAN,
            "HunyuanVideo": HUNYUAN_VIDEO, "LTX-Video 2B": LTXV, "Mochi": MOCHI}


def section(page: str, heading: str) -> str:
    text = (ROOT / "docs" / page).read_text()
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start:end if end >= 0 else len(text)]


def tables(text: str) -> list[list[dict[str, str]]]:
    """Every Markdown table of ``text``, each a list of rows keyed by its header."""
    found = []
    for block in re.findall(r"(?:^\|.*\|\n)+", text + "\n", re.MULTILINE):
        lines = [[cell.strip() for cell in line.strip("|").split("|")] for line in block.strip().splitlines()]
        found.append([dict(zip(lines[0], cells, strict=True)) for cells in lines[2:]])
    return found


def speedup(cell: str) -> float:
    """The first figure of a cell: ``42 ms (0.87x)`` and ``0.66x (1.02x)`` alike."""
    return float(re.search(r"(\d+\.\d+)x", cell).group(1))


def measured_in_docs() -> dict[tuple, tuple[str, list[tuple[str, float]]]]:
    """``{(family, setting, compiled): (model, [(size, speed-up), ...])}``, as the tables hold them."""
    cells: dict[tuple, tuple[str, list]] = {}

    def add(model, family, setting, compiled, size, figure):
        cells.setdefault((family, setting, compiled), (model, []))[1].append((size, figure))

    unets, dits = tables(section("BENCHMARKS.md", "## On a GPU (one H200)"))[:2]
    for row in unets:
        for column, setting in UNET_COLUMNS.items():
            add(row["model"], FAMILIES[row["model"]], setting, False, f"{row['px']} px", speedup(row[column]))
    for row in dits:
        model, size = [part.strip() for part in row["model"].split(",")[:2]]
        for column, setting in DIT_COLUMNS.items():
            add(model, FAMILIES[model], setting, False, size, speedup(row[column]))
    compile_section = section("SPEED_STACK.md", "### torch.compile on a GPU")
    model, family, size = COMPILED_AT
    assert f"{model} at {size}" in compile_section
    for row in tables(compile_section)[0]:
        if row["variant"] in COMPILE_ROWS:
            add(model, family, COMPILE_ROWS[row["variant"]], True, size, speedup(row[COMPILE_COLUMN]))
    return cells


def test_every_setting_the_gpu_tables_show_losing_has_its_row_with_every_size_they_measured():
    docs = measured_in_docs()
    losing = {key for key, (_, sizes) in docs.items() if any(figure < 1.0 for _, figure in sizes)}
    assert set(rule.ROW_OF) == losing
    for key, row in rule.ROW_OF.items():
        model, sizes = docs[key]
        assert row.model == model
        assert [(m.size, m.speedup) for m in row.measured] == sizes, key


def test_the_sizes_the_rows_count_are_ascending_and_the_tables_sizes():
    for row in rule.ROWS:
        tokens = [m.tokens for m in row.measured]
        assert tokens == sorted(set(tokens)), row
    assert rule.ROW_OF[(LTXV, rule.Setting(rule.TOME, SCOPE_ATTENTION), False)].measured[0].size == "768x512 x 121"


def test_the_settings_page_quotes_every_rows_figures():
    text = section("SETTINGS.md", "## When the node warns on a GPU")
    lines = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    for row in rule.ROWS:
        figures = [f"{m.speedup:.2f}x" for m in row.measured]
        assert any(row.model in line.split(" | ")[0] and ("torch.compile" in line.split(" | ")[0]) == row.compiled
                   and all(figure in line for figure in figures) for line in lines), (row.model, row.setting)
