"""Every relative link and #anchor in the README, docs/ and the in-app help pages (web/docs/) resolves.

Anchors are GitHub's: the heading's text, lower-cased, punctuation dropped, spaces turned into hyphens, and a
-1, -2 suffix for repeats. The help pages link to the repository's docs by absolute GitHub address (ComfyUI
serves only web/ to the help panel), so those addresses are checked against this checkout too.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = "https://github.com/tome-sd/comfyui-tome/"  # [project.urls] Repository in pyproject.toml
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "web" / "docs").glob("*.md")])
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def without_code(markdown: str) -> str:
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", markdown))


def anchors(page: Path) -> set[str]:
    """The ids GitHub gives the headings of a Markdown page."""
    seen: dict[str, int] = {}
    ids = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", page.read_text()), re.MULTILINE):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.replace("`", ""))
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        ids.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return ids


def local_target(page: Path, target: str) -> str | None:
    """The link's target as a path relative to the page, or None for a link outside this repository."""
    for prefix in ("blob/main/", "tree/main/"):
        if target.startswith(REPOSITORY + prefix):
            return "/" + target.removeprefix(REPOSITORY + prefix)
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):
        return None
    return target


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(without_code(page.read_text())):
        local = local_target(page, target)
        if local is None:
            continue
        path, _, anchor = local.partition("#")
        resolved = (ROOT / path.lstrip("/")) if path.startswith("/") else (page.parent / path if path else page)
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            broken.append(f"{target}: no such heading")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_resolves(page):
    assert broken_links(page) == []


def test_the_pages_are_found():
    """The parametrised test above covers the README, every page of docs/ and the three help pages."""
    names = {str(p.relative_to(ROOT)) for p in PAGES}
    assert {"README.md", "docs/BENCHMARKS.md", "docs/DITS.md", "docs/CLIENT.md", "docs/DEVELOPING.md",
            "web/docs/ApplyToMe.md", "web/docs/ApplyToMeAdvanced.md", "web/docs/ApplyToDo.md"} <= names


def test_a_broken_link_and_a_missing_anchor_are_found(tmp_path):
    """The checker itself: a missing file and a missing heading are both reported, good ones are not."""
    (tmp_path / "other.md").write_text("# On DiTs: SD3.5, Flux / Z-Image\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text("[a](other.md#on-dits-sd35-flux--z-image) [b](other.md#twice-1) [c](#top)\n\n# Top\n"
                    "[d](missing.md) [e](other.md#nowhere) `[f](in-code.md)` [g](https://example.com/x.md)\n")
    assert [line.split(":")[0] for line in broken_links(page)] == ["missing.md", "other.md#nowhere"]
