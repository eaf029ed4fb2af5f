"""The GPU rule alone (``tome.hosts.gpu_rule``): every cell of its table, sizes between the cells, the CPU, compile.

The table itself is held to docs/BENCHMARKS.md and docs/SPEED_STACK.md by tests/docs/test_gpu_table.py; the
warning given once per sampling run, by tests/comfy/test_gpu_warning.py.
"""

import pytest

from tome.hosts import gpu_rule as rule
from tome.hosts.dit_families import FLUX, SD3, WAN
from tome.hosts.dit_settings import SCOPE_ATTENTION, SCOPE_BLOCK

TOME_SELF = rule.Setting(rule.TOME, rule.SELF_ATTENTION)
TOME_WIDER = rule.Setting(rule.TOME, rule.WIDER)
TODO_UNET = rule.Setting(rule.TODO, rule.SELF_ATTENTION)
TOME_ATTENTION = rule.Setting(rule.TOME, SCOPE_ATTENTION)
TODO_ATTENTION = rule.Setting(rule.TODO, SCOPE_ATTENTION)
CELLS = [(row, cell) for row in rule.ROWS for cell in row.measured]


def cell_id(row_cell) -> str:
    row, cell = row_cell
    return f"{row.model}-{rule.describe(row.setting, row.compiled)}-{cell.size}"


@pytest.mark.parametrize("row_cell", [rc for rc in CELLS if rc[1].speedup < 1.0], ids=cell_id)
def test_a_losing_cell_warns_on_a_gpu_with_its_figure_and_what_to_do_instead(row_cell):
    row, cell = row_cell
    line = rule.gpu_warning("cuda", cell.tokens, row.family, [row.setting], compiled=row.compiled)
    assert line is not None and "\n" not in line
    assert f"{rule.describe(row.setting, row.compiled)} ran at {cell.speedup:.2f}x" in line
    assert f"on {row.model} at {cell.size} ({cell.tokens} tokens" in line
    assert f"instead, {row.instead}" in line
    assert line.endswith(rule.RULE_DOC)


@pytest.mark.parametrize("row_cell", [rc for rc in CELLS if rc[1].speedup >= 1.0], ids=cell_id)
def test_a_gaining_cell_does_not_warn(row_cell):
    row, cell = row_cell
    assert rule.gpu_warning("cuda", cell.tokens, row.family, [row.setting], compiled=row.compiled) is None


@pytest.mark.parametrize("row_cell", CELLS, ids=cell_id)
def test_the_cpu_never_warns(row_cell):
    row, cell = row_cell
    for tokens in (1, cell.tokens, 10 * cell.tokens):
        assert rule.gpu_warning("cpu", tokens, row.family, [row.setting], compiled=row.compiled) is None


@pytest.mark.parametrize("device_type", ["cuda", "xpu", "mps", "npu", "privateuseone"])
def test_every_accelerator_but_the_cpu_warns(device_type):
    assert f"on a GPU ({device_type})" in rule.gpu_warning(device_type, 128 ** 2, rule.SD15, [TOME_SELF])


@pytest.mark.parametrize("px, quoted", [(256, "512 px"), (512, "512 px"), (768, "1024 px"), (1024, "1024 px"),
                                        (1536, None), (2048, None), (4096, None)])
def test_a_size_between_measurements_loses_up_to_the_largest_losing_size_and_below_the_first_gain(px, quoted):
    """SD1.5's ToMe lost at 512 and 1024 px and gained at 2048 px: smaller sizes quote the nearest loss above
    them; between 1024 and 2048 px nothing is known to lose, and from 2048 px it gains."""
    line = rule.gpu_warning("cuda", (px // 8) ** 2, rule.SD15, [TOME_SELF])
    assert (line is None) == (quoted is None)
    if quoted is not None:
        assert f"on SD1.5 at {quoted} (" in line and ", gaining only from 2048 px)" in line


def test_above_the_largest_losing_size_nothing_warns_even_where_no_size_gained():
    """SDXL's fast setting lost at 1024 and 2048 px: above 2048 px nothing was measured, so nothing is said."""
    assert "0.66x" in rule.gpu_warning("cuda", (2048 // 8) ** 2, rule.SDXL, [TOME_WIDER])
    assert rule.gpu_warning("cuda", (2048 // 8) ** 2 + 1, rule.SDXL, [TOME_WIDER]) is None


def test_settings_and_families_the_table_did_not_measure_losing_never_warn():
    assert rule.gpu_warning("cuda", 64 ** 2, rule.SD15, [TODO_UNET]) is None  # ToDo gained at every size
    assert rule.gpu_warning("cuda", 64 ** 2, WAN, [TOME_ATTENTION]) is None  # the video DiTs gained
    assert rule.gpu_warning("cuda", 64 ** 2, FLUX, [rule.Setting(rule.TOME, SCOPE_BLOCK)]) is None
    assert rule.gpu_warning("cuda", 64 ** 2, None, [TOME_SELF]) is None  # a U-Net the table did not time
    assert rule.gpu_use(rule.SD15, [TODO_UNET]) is None and rule.gpu_use(None, [TOME_SELF]) is None
    assert rule.gpu_use(rule.SD15, [TOME_SELF, TODO_UNET]) == rule.GpuUse(rule.SD15, (TOME_SELF, TODO_UNET))


def test_a_compiled_run_reads_the_compiled_rows_where_they_were_measured():
    """SD3.5 medium's ToDo 2 gained uncompiled (1.11x) and lost compiled (0.96x of compiled no patch); Flux was
    not compiled on a GPU, so its uncompiled row stands."""
    tokens = 64 ** 2
    assert rule.gpu_warning("cuda", tokens, SD3, [TODO_ATTENTION]) is None
    assert "Apply ToDo at dit_scope 'attention' under torch.compile ran at 0.96x the speed of the compiled " \
        "unpatched model" in rule.gpu_warning("cuda", tokens, SD3, [TODO_ATTENTION], compiled=True)
    assert rule.gpu_use(SD3, [TODO_ATTENTION]) is not None  # compile is known only when the run starts
    assert "0.84x" in rule.gpu_warning("cuda", tokens, FLUX, [TOME_ATTENTION], compiled=True)


def test_two_losing_settings_give_one_line_naming_both():
    line = rule.gpu_warning("cuda", 128 ** 2, rule.SDXL, [TOME_SELF, TODO_UNET])
    assert line.startswith("Apply ToMe / Apply ToDo on a GPU (cuda): this run's image has 16384 tokens")
    assert "0.82x" in line and "0.96x" in line
    only_tome = rule.gpu_warning("cuda", 256 ** 2, rule.SDXL, [TOME_WIDER, TODO_UNET])  # ToDo gains at 2048 px
    assert only_tome.startswith("Apply ToMe on a GPU") and "Apply ToDo ran" not in only_tome


@pytest.mark.parametrize("latent, patch, tokens", [
    ((2, 4, 128, 128), (1, 1, 1), 128 ** 2),  # a U-Net's latent cells, per image
    ((1, 16, 128, 128), (1, 2, 2), 64 ** 2),  # Flux at 1024 px: bench/records/gpu/flux-1024px-bf16-h200-block.json
    ((1, 128, 16, 16, 24), (1, 1, 1), rule.LTXV_121),  # LTX-Video at 768x512 x 121: its record's latent
])
def test_a_latent_counts_its_image_tokens_per_image_as_the_table_does(latent, patch, tokens):
    assert rule.image_tokens(latent, patch) == tokens
    assert rule.GpuUse(rule.SD15, (TOME_SELF,), patch).warning("cuda", latent) == \
        rule.gpu_warning("cuda", tokens, rule.SD15, [TOME_SELF])
