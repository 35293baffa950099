"""The book's parts agree: every notebook is in the table of contents, every refimpl module is
in the API reference, every citation has a bibliography entry, and chapter, module and test
names line up."""

from __future__ import annotations

import pkgutil
import re
from pathlib import Path

import nbformat
import yaml

import refimpl
import refimpl.demos

ROOT = Path(__file__).resolve().parent.parent


def _toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [toc["root"]] + [c["file"] for p in toc["parts"] for c in p["chapters"]]


def test_every_toc_entry_exists_and_every_notebook_is_listed() -> None:
    files = _toc_files()
    for entry in files:
        assert any((ROOT / f"{entry}{ext}").exists() for ext in (".md", ".ipynb")), entry
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert f"notebooks/{nb.stem}" in files, f"{nb.name} is not in _toc.yml"


def test_chapters_are_numbered_in_order_and_titled_with_their_number() -> None:
    chapters = [f for f in _toc_files() if f.startswith("notebooks/")]
    numbers = [int(Path(f).name.split("_")[0]) for f in chapters]
    assert numbers == sorted(numbers)
    for f, n in zip(chapters, numbers, strict=True):
        title = nbformat.read(ROOT / f"{f}.ipynb", as_version=4).cells[0].source.splitlines()[0]
        assert title.startswith(f"# {n}. "), f"{f}: first line should be '# {n}. Title'"


def test_every_public_refimpl_module_is_in_the_api_reference() -> None:
    api = (ROOT / "book" / "api.md").read_text()
    documented = set(re.findall(r"automodule:: (refimpl[\w.]*)", api))

    public = {
        f"refimpl.{m.name}" for m in pkgutil.iter_modules(refimpl.__path__) if m.name[0] != "_"
    }
    public |= {
        f"refimpl.demos.{m.name}"
        for m in pkgutil.iter_modules(refimpl.demos.__path__)
        if m.name[0] != "_"
    }
    assert public <= documented, f"missing from book/api.md: {sorted(public - documented)}"


def test_every_citation_has_a_bibliography_entry() -> None:
    bib = (ROOT / "book" / "references.bib").read_text()
    keys = set(re.findall(r"@\w+\{([^,]+),", bib))
    cited: set[str] = set()
    sources = [p.read_text() for p in (ROOT / "book").glob("*.md")]
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        sources += [c.source for c in nbformat.read(nb, as_version=4).cells]
    for text in sources:
        for group in re.findall(r"\{cite(?::\w+)?\}`([^`]+)`", text):
            cited |= {k.strip() for k in group.split(",")}
    assert cited, "no citations found: the bibliography would be empty"
    assert cited <= keys, f"cited but not in book/references.bib: {sorted(cited - keys)}"


def test_each_refimpl_module_has_a_test_file() -> None:
    """Module X is tested in tests/test_X.py; its demos (refimpl.demos.X) are tested there too."""

    modules = [m.name for m in pkgutil.iter_modules(refimpl.__path__) if not m.ispkg]
    modules += [m.name for m in pkgutil.iter_modules(refimpl.demos.__path__)]
    for name in modules:
        if name[0] != "_":
            assert (ROOT / "tests" / f"test_{name}.py").exists(), f"no tests/test_{name}.py"


def test_the_library_never_imports_a_demo_or_a_benchmark() -> None:
    """What a trainer imports (refimpl.X) must not pull in the book's demos or benchmarks."""
    for path in sorted((ROOT / "src" / "refimpl").glob("*.py")):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import) refimpl\.(demos|bench)", text, re.M), path.name
