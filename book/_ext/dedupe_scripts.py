"""Drop duplicate inline <script> lines from the built HTML pages.

jupyter-book 1.0.4 runs sphinx-thebe's and sphinx-togglebutton's set-up twice, so every page
declares ``const THEBE_JS_URL`` twice and the browser logs a SyntaxError. The book's browser
test fails on any unexpected console error, so after the build the second copy of any
identical ``<script>`` line in a page's head is removed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _dedupe_file(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    head, sep, body = text.partition("</head>")
    seen: set[str] = set()
    kept = []
    for line in head.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("<script") and stripped.endswith("</script>"):
            if stripped in seen:
                continue
            seen.add(stripped)
        kept.append(line)
    new = "".join(kept) + sep + body
    if new != text:
        path.write_text(new, encoding="utf-8")


def _dedupe_all(app: Any, exception: Exception | None) -> None:
    if exception is None and app.builder.format == "html":
        for path in Path(app.outdir).rglob("*.html"):
            _dedupe_file(path)


def setup(app: Any) -> dict[str, Any]:
    app.connect("build-finished", _dedupe_all)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
