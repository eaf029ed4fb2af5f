"""The README stays a five-minute read: the pack's limit, with the full tables in docs/."""

from tome_harness.comfyui import ROOT

MAX_LINES = 250


def test_the_readme_is_read_in_minutes():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/ (limit {MAX_LINES})"


def test_the_readme_leads_with_one_row_per_family_most_people_run():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Settings per model"):text.index("## Example workflows")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    assert [row.split(" | ")[0].removeprefix("| ").split(",")[0] for row in rows] == [
        "SD1.5 / SD2.x", "SDXL", "SD3.5 medium", "Flux", "Wan 2.1 1.3B", "Qwen-Image"]
