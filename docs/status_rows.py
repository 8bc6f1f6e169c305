"""The status table's rows where other pages repeat them: written once, in docs/status.md.

A page that shows a capability's status repeats its row of docs/status.md (the same first cell).
`synced(text, page)` returns the page with each such row replaced by status.md's, its relative
links rewritten for the page's folder; the site's build applies it (`docs/hooks.py`), and

    python docs/status_rows.py

rewrites the pages in place, so that they read the same in the repository
(`tests/test_docs.py` checks that they do).
"""
from __future__ import annotations

import os
import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parent
STATUS = "status.md"
_LINK = re.compile(r"\]\((?!https?:|#|/)([^)#\s]+)")


def _first_cell(line: str) -> str | None:
    if not line.startswith("| ") or line.startswith("|---"):
        return None
    return line.split("|")[1].strip()


def status_rows() -> dict[str, str]:
    """docs/status.md's table rows by their first cell (the capability)."""
    rows = {}
    for line in (DOCS / STATUS).read_text().splitlines():
        cell = _first_cell(line)
        if cell and cell != "feature":
            rows[cell] = line
    return rows


def _relinked(row: str, page: str) -> str:
    """`row` (links relative to docs/) with its links relative to the folder of `page`."""
    folder = os.path.dirname(page)
    if not folder:
        return row
    return _LINK.sub(lambda m: "](" + os.path.relpath(m.group(1), folder), row)


def synced(text: str, page: str, rows: dict[str, str] | None = None) -> str:
    """`text` of the page `page` (its path under docs/) with every row that repeats a status row
    replaced by that row.

    Args:
      text: the page's markdown.
      page: its path relative to docs/, e.g. `axes/depth.md`.
      rows: `status_rows()` (read when None).

    Returns:
      The markdown, each repeated row as docs/status.md has it.
    """
    if page == STATUS:
        return text
    rows = status_rows() if rows is None else rows
    lines = text.split("\n")
    for i, line in enumerate(lines):
        cell = _first_cell(line)
        if cell in rows:
            lines[i] = _relinked(rows[cell], page)
    return "\n".join(lines)


def pages() -> list[str]:
    """Every hand-written page under docs/, relative to it."""
    return sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))


def main() -> int:
    rows = status_rows()
    for page in pages():
        path = DOCS / page
        text = path.read_text()
        new = synced(text, page, rows)
        if new != text:
            path.write_text(new)
            print(f"synced {page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
