"""The documentation's links resolve, and the README stays a front page.

Every relative link in README.md, docs/*.md and services/*/README.md must name a file or folder
that exists, and a ``#anchor`` must name a heading of the file it points into (GitHub's anchors:
lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2`` for repeats).  Links inside code
blocks and code spans are text, not links.  Absolute URLs are not fetched.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
# Written on other branches of the same session; linked before they land.  Once such a file exists its
# links and anchors are checked like any other: take it out of this set after the merge.
PENDING: set[str] = set()

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md")),
            *sorted((root / "services").glob("*/README.md"))]


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for no, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield no, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link in a heading anchors by its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path):
    """(line number, target) of every link in the file's prose."""
    for no, line in _prose_lines(path.read_text(encoding="utf-8")):
        for m in LINK.finditer(CODE_SPAN.sub("", line)):
            yield no, m.group(1)


def broken_links(files: list[Path], root: Path = ROOT, pending: set[str] = frozenset()) -> list[str]:
    """One line per link that points nowhere: file:line: target (why)."""
    problems = []
    cache: dict[Path, set[str]] = {}
    for f in files:
        for no, target in links(f):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):   # http:, https:, mailto:
                continue
            where = f"{f.relative_to(root)}:{no}: {target}"
            path_part, _, anchor = target.partition("#")
            dest = (f.parent / path_part).resolve() if path_part else f
            if not dest.exists():
                rel = dest.relative_to(root).as_posix() if dest.is_relative_to(root) else str(dest)
                if rel not in pending:
                    problems.append(f"{where} (no such file: {rel})")
                continue
            if anchor:
                if dest.is_dir() or dest.suffix != ".md":
                    problems.append(f"{where} (an anchor into something that is not a markdown file)")
                    continue
                if dest not in cache:
                    cache[dest] = anchors(dest)
                if anchor not in cache[dest]:
                    problems.append(f"{where} (no heading with anchor #{anchor} in {dest.name})")
    return problems


def test_every_link_and_anchor_resolves():
    files = doc_files()
    assert (ROOT / "README.md") in files and len(files) > 5
    problems = broken_links(files, pending=PENDING)
    assert not problems, "links that point nowhere:\n" + "\n".join(problems)


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, the limit is {README_MAX_LINES}: move the details to docs/ and link them")


def test_the_readme_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text


@pytest.mark.parametrize("heading, anchor", [
    ("State operations (`bench/kvs_ops.py`)", "state-operations-benchkvs_opspy"),
    ("sdhcp: time to lease, vs Kea and dnsmasq", "sdhcp-time-to-lease-vs-kea-and-dnsmasq"),
    ("The goal, ≤ Kea's time with 4 shards", "the-goal--keas-time-with-4-shards"),
    ("Issue 7: the state layer's speed goals", "issue-7-the-state-layers-speed-goals"),
])
def test_slug_is_githubs(heading, anchor):
    assert slug(heading) == anchor


def test_the_checker_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Second part\n\ntext\n", encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Top\n\n"
        "[ok](docs/a.md) [ok anchor](docs/a.md#second-part) [self](#top) [web](https://example.org/x)\n"
        "[gone](docs/missing.md) [bad anchor](docs/a.md#third-part) [bad self](#nowhere)\n"
        "`[in code](docs/nothing.md)`\n"
        "```\n[in a block](docs/nothing.md)\n```\n"
        "[pending](docs/later.md)\n",
        encoding="utf-8")
    problems = broken_links([readme, tmp_path / "docs" / "a.md"], root=tmp_path, pending={"docs/later.md"})
    assert [p.split(" (")[0] for p in problems] == [
        "README.md:4: docs/missing.md", "README.md:4: docs/a.md#third-part", "README.md:4: #nowhere"]
