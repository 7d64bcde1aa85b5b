"""The user's pages: every relative link points at a file of the repo, and no placeholder is left for a number."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = sorted((ROOT / "notebooks" / "src").glob("*.py"))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
PLACEHOLDER = re.compile(r"TODO\(|RESULTS\(|TBD\b|XXX")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    missing = [
        target
        for target in LINK.findall(page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert not missing, f"{page.name} links to missing files: {missing}"


@pytest.mark.parametrize("page", PAGES + SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_placeholder_is_left(page):
    hits = [line.strip() for line in page.read_text().splitlines() if PLACEHOLDER.search(line)]
    assert not hits, f"{page.name} still has placeholders: {hits[:3]}"


def test_the_readme_stays_a_short_users_guide():
    """Measurements and their history live in docs/ and benchmarks/README.md; the README stays under 15 KiB."""
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 15 * 1024, f"README.md is {size} bytes: move detail to docs/"


ISSUE = re.compile(r"\bissues? #?\d+|\(#\d+\)", re.I)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_cites_an_issue_number(page):
    """A reader cannot see the tracker: a page says what an issue asked, not its number."""
    hits = [line.strip() for line in page.read_text().splitlines() if ISSUE.search(line)]
    assert not hits, f"{page.name} cites issue numbers: {hits[:3]}"


def test_the_benchmarks_page_keeps_the_current_measurements_only():
    """benchmarks/README.md holds each topic's latest table; its history is a short record (the full notebook is in
    git), so the page stays under 25 KB."""
    size = len((ROOT / "benchmarks" / "README.md").read_bytes())
    assert size <= 25_000, f"benchmarks/README.md is {size} bytes: move history to its record section"
