"""Two fixes to the built HTML, applied after the build.

1. jupyter-book 1.0.4 runs sphinx-thebe's and sphinx-togglebutton's set-up twice, so every
   page declares ``const THEBE_JS_URL`` twice and the browser logs a SyntaxError. The second
   copy of any identical ``<script>`` line in a page's head is removed.
2. The vendored widget bundle (book/_static/widgets) loads its icon fonts relative to the
   *page*, from the folder of whichever of its AMD modules registers the CSS first:
   ``@jupyter-widgets/`` (base, controls) or ``@jupyter-widgets/html-manager/dist/``
   (libembed-amd). Which one wins varies from load to load, so the fonts are copied to both
   folders next to every page that shows a widget.

The book's browser test fails on any unexpected console error; these are the two it found.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

FONT_DIR = Path(__file__).resolve().parent.parent / "_static" / "widgets" / "fonts"
WIDGET_BUNDLE = "embed-amd-"
FONT_FOLDERS = ("@jupyter-widgets", "@jupyter-widgets/html-manager/dist")


def _dedupe_scripts(text: str) -> str:
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
    return "".join(kept) + sep + body


def _fix_all(app: Any, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    for path in Path(app.outdir).rglob("*.html"):
        text = path.read_text(encoding="utf-8")
        new = _dedupe_scripts(text)
        if new != text:
            path.write_text(new, encoding="utf-8")
        if WIDGET_BUNDLE in new:
            for sub in FONT_FOLDERS:
                fonts = path.parent / sub
                fonts.mkdir(parents=True, exist_ok=True)
                for font in FONT_DIR.glob("*.woff2"):
                    shutil.copy2(font, fonts / font.name)


def setup(app: Any) -> dict[str, Any]:
    app.connect("build-finished", _fix_all)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
