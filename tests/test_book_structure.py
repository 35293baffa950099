"""The book's parts agree: every notebook is in the table of contents, every refimpl module is
in the API reference, every citation has a bibliography entry, chapter, module and test names
line up, code announced with a colon comes before the next heading, and the chapters link to
each other, the API page and the glossary."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import re
from pathlib import Path

import nbformat
import pybtex.database
import pytest
import yaml
from helpers.scripts import load_script

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


def _api_pages() -> list[Path]:
    return sorted((ROOT / "book" / "api").glob("*.md"))


def test_the_api_reference_has_one_page_per_module() -> None:
    """book/api.md is the index; each library module has its own page under book/api/, listed
    under it in _toc.yml; only the benchmarks and the demos share a page each."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    entries = [c for part in toc["parts"] for c in part["chapters"] if c["file"] == "book/api"]
    assert len(entries) == 1, "_toc.yml lists book/api once"
    sections = [s["file"] for s in entries[0].get("sections", [])]
    assert sections == sorted(sections, key=sections.index) and len(set(sections)) == len(sections)
    assert {f"book/api/{p.stem}" for p in _api_pages()} == set(sections), sections
    index = (ROOT / "book" / "api.md").read_text()
    assert "automodule::" not in index, "book/api.md is the index; the modules have their pages"
    for page in _api_pages():
        modules = re.findall(r"automodule:: (refimpl[\w.]*)", page.read_text())
        assert modules and modules[0] == f"refimpl.{page.stem}", page.name
        if page.stem not in ("bench", "demos"):
            assert len(modules) == 1, f"{page.name} documents {modules}"
        assert f"](api/{page.stem}.md)" in index, f"book/api.md does not list {page.name}"


def test_every_public_refimpl_module_is_in_the_api_reference() -> None:
    api = "\n".join(p.read_text() for p in _api_pages())
    documented = set(re.findall(r"automodule:: (refimpl[\w.]*)", api))

    public = {
        f"refimpl.{m.name}" for m in pkgutil.iter_modules(refimpl.__path__) if m.name[0] != "_"
    }
    public |= {
        f"refimpl.demos.{m.name}"
        for m in pkgutil.iter_modules(refimpl.demos.__path__)
        if m.name[0] != "_"
    }
    assert public <= documented, f"missing from book/api/: {sorted(public - documented)}"


def test_every_public_constant_is_documented_on_its_api_page() -> None:
    """``automodule`` shows a constant only if the module assigns it with a docstring; one that
    a package re-exports from a submodule needs an ``autodata`` line on the page (and a
    docstring where it is assigned, which book/_ext/reexported_data.py then shows)."""
    from sphinx.pycode import ModuleAnalyzer

    extension = load_script("book/_ext/reexported_data.py")  # documents re-exported constants
    undocumented = []
    for page in _api_pages():
        text = page.read_text()
        for name in re.findall(r"automodule:: (refimpl[\w.]*)", text):
            module = importlib.import_module(name)
            own = ModuleAnalyzer.for_module(name).find_attr_docs()
            for attr in getattr(module, "__all__", ()):
                value = getattr(module, attr)
                if inspect.isclass(value) or callable(value) or inspect.ismodule(value):
                    continue
                if ("", attr) in own:
                    continue
                if f"autodata:: {name}.{attr}\n" not in text:
                    undocumented.append(f"{page.name}: no autodata:: {name}.{attr}")
                elif not extension.docstring_of(name, attr):
                    undocumented.append(f"{name}.{attr}: no docstring where it is assigned")
    assert not undocumented, "\n".join(undocumented)


def test_every_citation_has_a_bibliography_entry() -> None:
    bib = (ROOT / "book" / "references.bib").read_text()
    keys = set(re.findall(r"@\w+\{([^,]+),", bib))
    # Parsed as the book's build parses it (pybtex, strict: a duplicate field or an entry
    # swallowed by a lost brace, as two merges left it once, is an error here, not a warning).
    parsed = pybtex.database.parse_string(bib, "bibtex")
    assert set(parsed.entries) == keys, sorted(keys ^ set(parsed.entries))
    assert all("title" in e.fields for e in parsed.entries.values())
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
    """Module X is tested in tests/test_X.py; a demo refimpl.demos.X in tests/demos/test_X.py,
    or in tests/test_X.py beside its library module's tests when the names are the same."""

    modules = [m.name for m in pkgutil.iter_modules(refimpl.__path__) if not m.ispkg]
    for name in modules:
        if name[0] != "_":
            assert (ROOT / "tests" / f"test_{name}.py").exists(), f"no tests/test_{name}.py"
    for m in pkgutil.iter_modules(refimpl.demos.__path__):
        places = [ROOT / "tests" / "demos" / f"test_{m.name}.py"]
        if m.name in {top.name for top in pkgutil.iter_modules(refimpl.__path__)}:
            places.append(ROOT / "tests" / f"test_{m.name}.py")
        assert any(p.exists() for p in places), f"no tests/demos/test_{m.name}.py"


def test_the_library_never_imports_a_demo_or_a_benchmark() -> None:
    """What a trainer imports (refimpl.X) must not pull in the book's demos or benchmarks."""
    for path in sorted((ROOT / "src" / "refimpl").glob("*.py")):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import) refimpl\.(demos|bench)", text, re.M), path.name


def test_no_refimpl_code_switches_the_matplotlib_backend() -> None:
    """A chapter that calls a benchmark or a demo keeps its inline figures: refimpl draws with
    pyplot inside the caller's backend, or with `matplotlib.figure.Figure`, never
    ``matplotlib.use(...)`` (which turned inline figures off for every later cell)."""
    for path in sorted((ROOT / "src" / "refimpl").rglob("*.py")):
        code = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
        assert not any("matplotlib.use(" in ln for ln in code), path.relative_to(ROOT)
    # Choosing the backend in a chapter's first code cell is set-up; later, a workaround.
    switches = [
        f"{nb.name} code cell {i}"
        for nb in sorted((ROOT / "notebooks").glob("*.ipynb"))
        for i, cell in enumerate(
            c for c in nbformat.read(nb, as_version=4).cells if c.cell_type == "code"
        )
        if i > 0 and "%matplotlib" in cell.source
    ]
    assert not switches, f"a cell switches the backend back (who changed it?): {switches}"


_HEADING = re.compile(r"#{1,6} ")
_FENCE = re.compile(r"(`{3,}|:{3,})")


def _blocks(markdown: str) -> list[str]:
    """A markdown cell's blocks: paragraphs or lists, fenced blocks (whole), headings (alone)."""
    blocks: list[list[str]] = []
    current: list[str] = []
    fence = ""
    for line in markdown.splitlines():
        stripped = line.strip()
        if fence:
            current.append(line)
            if stripped.startswith(fence) and not stripped.strip(fence[0]):
                blocks.append(current)
                current, fence = [], ""
            continue
        opening = _FENCE.match(stripped)
        if not stripped or _HEADING.match(line) or opening:
            if current:
                blocks.append(current)
            current = []
        if opening:
            fence = opening.group(1)
            current = [line]
        elif _HEADING.match(line):
            blocks.append([line])
        elif stripped:
            current.append(line)
    if current:
        blocks.append(current)
    return ["\n".join(b) for b in blocks]


def _announcements_without_their_code(cells: list) -> list[str]:
    """Paragraphs ending in a colon that a heading follows before any code cell does."""
    found = []
    for i, cell in enumerate(cells):
        if cell.cell_type != "markdown":
            continue
        blocks = _blocks(cell.source)
        for j, block in enumerate(blocks):
            if not block.endswith(":") or _HEADING.match(block) or _FENCE.match(block):
                continue
            where = f"cell {i}: ...{block[-50:]!r}"
            if j + 1 < len(blocks):  # the announced thing is in the same cell, unless a heading
                if _HEADING.match(blocks[j + 1]):
                    found.append(f"{where} is followed by {blocks[j + 1]!r}")
                continue
            for later in cells[i + 1 :]:
                if later.cell_type == "code":
                    break
                heading = next((b for b in _blocks(later.source) if _HEADING.match(b)), None)
                if heading is not None:
                    found.append(f"{where} is followed by {heading!r}")
                    break
            else:
                found.append(f"{where} ends the chapter")
    return found


def test_announcing_colon_checker_catches_a_misplaced_heading() -> None:
    new = nbformat.v4
    announce = "The numbers are printed below:"
    bad_in_cell = [new.new_markdown_cell(f"{announce}\n\n## Next section"), new.new_code_cell("")]
    bad_next = [
        new.new_markdown_cell(announce),
        new.new_markdown_cell("## Next"),
        new.new_code_cell(""),
    ]
    bad_last = [new.new_markdown_cell(announce)]
    good = [new.new_markdown_cell("Three cases:\n\n- a\n- b\n\n## Next"), new.new_code_cell("")]
    fenced = [new.new_markdown_cell(":::{note}\nsee:\n:::\n\n## Next"), new.new_code_cell("")]
    good_code = [new.new_markdown_cell(announce), new.new_code_cell("print(1)")]
    for cells in (bad_in_cell, bad_next, bad_last):
        assert _announcements_without_their_code(cells), cells
    for cells in (good, fenced, good_code):
        assert not _announcements_without_their_code(cells), cells


def test_code_announced_with_a_colon_comes_before_the_next_heading() -> None:
    """A paragraph ending "...below:" then a heading puts the code under the wrong section."""
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        found = _announcements_without_their_code(nbformat.read(path, as_version=4).cells)
        assert not found, f"{path.name}: move the heading above the announcing paragraph: {found}"


_LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+\.(?:ipynb|md))(?:#[^)]*)?\)")


def _chapters() -> list[Path]:
    return sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_every_chapter_links_to_other_chapters_the_api_and_the_glossary() -> None:
    """Each chapter links to another chapter, to the API page, to the glossary, and ends with a
    link to the next chapter (the last one back to the start)."""
    chapters = _chapters()
    for n, path in enumerate(chapters):
        cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown"]
        text = "\n".join(c.source for c in cells)
        others = {t for t in _LINK.findall(text) if t != path.name and t.endswith(".ipynb")}
        assert others, f"{path.name} links to no other chapter"
        assert re.search(r"\{py:(func|class|mod|meth)\}`", text), f"{path.name}: no API link"
        assert "{term}`" in text, f"{path.name}: no glossary link"
        last = cells[-1].source
        if n + 1 < len(chapters):
            assert last.startswith("Next: ") and chapters[n + 1].name in _LINK.findall(last), (
                f"{path.name} should end with 'Next: [chapter ...]({chapters[n + 1].name})'"
            )
        else:
            assert "../book/intro.md" in _LINK.findall(last), f"{path.name}: no way back"


def test_every_link_to_a_chapter_or_page_points_at_a_file() -> None:
    sources = [(p, p.read_text()) for p in (ROOT / "book").rglob("*.md")]
    for path in _chapters():
        nb = nbformat.read(path, as_version=4)
        sources += [(path, c.source) for c in nb.cells if c.cell_type == "markdown"]
    checked = 0
    for path, text in sources:
        for target in _LINK.findall(text):
            if "://" not in target:
                assert (path.parent / target).resolve().exists(), f"{path.name}: {target}"
                checked += 1
    assert checked >= 2 * len(_chapters()), checked


def test_the_glossary_points_back_to_the_chapters() -> None:
    glossary = (ROOT / "book" / "glossary.md").read_text()
    assert "```{glossary}" in glossary, "{term} roles need a Sphinx glossary"
    assert not re.search(r"\(ch\. \d", glossary), "a plain-text (ch. N) pointer is left"
    assert len(re.findall(r"\]\(\.\./notebooks/\d\d_\w+\.ipynb\)", glossary)) >= 20


CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _headings(cells: list[nbformat.NotebookNode]) -> list[str]:
    return [
        line
        for c in cells
        if c.cell_type == "markdown"
        for line in c.source.splitlines()
        if line.startswith("## ")
    ]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem[:2])
def test_the_chapter_ends_with_a_summary_then_exercises_with_folded_answers(path: Path) -> None:
    """Summary (3-6 bullets), then Exercises (3-5 tasks, answers folded), then the Next link."""
    cells = nbformat.read(path, as_version=4).cells
    heads = _headings(cells)
    assert heads[-2:] == ["## Summary", "## Exercises"], f"{path.name} ends with {heads[-2:]}"
    text = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    summary = text[text.index("\n## Summary") : text.index("\n## Exercises")]
    bullets = re.findall(r"^- ", summary, re.MULTILINE)
    assert 3 <= len(bullets) <= 6, f"{path.name}: {len(bullets)} summary bullets"
    exercises = text[text.index("\n## Exercises") :]
    tasks = re.findall(r"^\d+\. ", exercises.split("```")[0], re.MULTILINE)
    assert 3 <= len(tasks) <= 5, f"{path.name}: {len(tasks)} exercises"
    assert re.search(r":class: dropdown", exercises), f"{path.name}: answers are not folded"


_RUN_BOX = re.compile(r"```\{admonition\} Run this chapter\n(?:.*\n)*?```", re.MULTILINE)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem[:2])
def test_the_chapter_opens_with_a_run_this_chapter_box(path: Path) -> None:
    """The command, what it needs and how long it takes, before the first section."""
    cells = nbformat.read(path, as_version=4).cells
    first_section = next(
        i for i, c in enumerate(cells) if c.cell_type == "markdown" and "\n## " in "\n" + c.source
    )
    opening = "\n".join(c.source for c in cells[: first_section + 1] if c.cell_type == "markdown")
    box = _RUN_BOX.search(opening)
    assert box, f"{path.name}: no 'Run this chapter' box before its first section"
    for needed in ("make lab", f"make chapter N={path.name[:2]}", "2-core", "GPU"):
        assert needed in box.group(0), f"{path.name}: the run box does not say {needed!r}"


def _figure_cells(path: Path) -> list[tuple[int, nbformat.NotebookNode]]:
    cells = nbformat.read(path, as_version=4).cells
    return [
        (i, c)
        for i, c in enumerate(cells)
        if c.cell_type == "code"
        and any(
            "image/png" in o.get("data", {}) or "image/svg+xml" in o.get("data", {})
            for o in c.outputs
        )
    ]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem[:2])
def test_every_figure_has_a_caption_and_alt_text(path: Path) -> None:
    """MyST-NB turns a plot cell's mystnb.figure (caption, name) and mystnb.image.alt into a
    numbered figure with alt text; the alt text describes the picture, the caption reads it."""
    for i, cell in _figure_cells(path):
        meta = cell.metadata.get("mystnb", {})
        caption = meta.get("figure", {}).get("caption", "")
        alt = meta.get("image", {}).get("alt", "")
        name = meta.get("figure", {}).get("name", "")
        assert len(caption) > 20 and len(alt) > 20, f"{path.name} cell {i}: caption/alt"
        assert caption != alt, f"{path.name} cell {i}: the alt text repeats the caption"
        assert re.fullmatch(r"fig-ch\d\d-[a-z0-9-]+", name), f"{path.name} cell {i}: {name!r}"
        assert name.startswith(f"fig-ch{path.name[:2]}-"), f"{path.name} cell {i}: {name!r}"


def test_figure_names_are_unique_across_the_book() -> None:
    names = [
        c.metadata.get("mystnb", {}).get("figure", {}).get("name", "")
        for path in CHAPTERS
        for _, c in _figure_cells(path)
    ]
    names = [n for n in names if n]
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem[:2])
def test_no_printed_line_is_wider_than_100_columns(path: Path) -> None:
    """Long messages are wrapped where they are printed; the book's CSS wrap is a fallback."""
    wide = []
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            text = out.get("text", "") or out.get("data", {}).get("text/plain", "")
            wide += [
                f"cell {i}: {line[:60]!r}... ({len(line)})"
                for line in "".join(text).splitlines()
                if len(line) > 100
            ]
    assert not wide, f"{path.name}: {len(wide)} lines: {wide[:10]}"


# "section 4.6" in prose, and a bare "(4.6)" or "as in 4.4" standing for a section; {ref}`...`
# spans (where the linked mentions live) are cut out before searching.
_SECTION_MENTION = re.compile(r"\b[Ss]ections? \d+\.\d+\b|\(\d\.\d\)|\bas in \d\.\d\b")
_REF = re.compile(r"\{ref\}`[^`]*<(sec-\d+-\d+)>`")


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem[:2])
def test_section_mentions_are_links_to_that_section(path: Path) -> None:
    """A reader who meets "section 5.7" can click it: each mention is a {ref} to the label
    (sec-5-7)= that sits right above the heading "## 5.7 ...", in the same chapter."""
    text = "\n".join(
        c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown"
    )
    labels = dict(re.findall(r"^\((sec-\d+-\d+)\)=\n## (\d+\.\d+) ", text, re.MULTILINE))
    for label, number in labels.items():
        assert label == f"sec-{number.replace('.', '-')}", f"{path.name}: {label} on {number}"
    refs = _REF.findall(text)
    missing = sorted(set(refs) - set(labels))
    assert not missing, f"{path.name}: links to sections it has no label for: {missing}"
    prose = re.sub(r"\{ref\}`[^`]*`", "", text)
    unlinked = [prose[max(0, m.start() - 40) : m.end()] for m in _SECTION_MENTION.finditer(prose)]
    assert not unlinked, f"{path.name}: section mentions that are not links: {unlinked}"


def test_the_test_order_table_names_only_files_that_exist() -> None:
    """tests/conftest.py hands files to the workers longest first from a table of seconds; an
    entry for a renamed or deleted file would silently stop doing its job."""
    from conftest import _SECONDS, expected_seconds

    missing = [name for name in _SECONDS if not (ROOT / name).is_file()]
    assert not missing, f"tests/conftest.py lists files that do not exist: {missing}"
    assert (
        expected_seconds("notebooks/10_fault_tolerant_training.ipynb::Cell 3")
        == _SECONDS["notebooks/10_fault_tolerant_training.ipynb"]
    )


def test_main_text_stays_within_the_word_targets() -> None:
    """Issue 40's targets: at most 4,500 words of main text (prose outside collapsed blocks)
    per chapter, under 40,000 for the book; depth goes into dropdowns, not into the page."""
    tool = load_script("tools/book_words.py")
    rows = tool.book_words()
    assert len(rows) == len(CHAPTERS)
    over = {r.path.name: r.main for r in rows if r.main > tool.CHAPTER_LIMIT}
    assert not over, f"chapters over {tool.CHAPTER_LIMIT} words of main text: {over}"
    total = sum(r.main for r in rows)
    assert total < tool.BOOK_LIMIT, f"{total} words of main text in all"


def test_the_word_count_leaves_out_code_and_collapsed_blocks() -> None:
    tool = load_script("tools/book_words.py")
    source = "\n".join(
        [
            "One two three.",
            "```python",
            "x = 1  # not prose",
            "```",
            "```{dropdown} Deep dive",
            "four five six seven",
            "```",
            "```{admonition} Answers",
            ":class: dropdown",
            "eight nine",
            "```",
            "```{note}",
            "Ten eleven.",
            "```",
            "<!-- a comment -->",
            "% a MyST comment",
        ]
    )
    # main: 3 + the two visible titles (2 + 1) + 2; collapsed: 4 + 2
    assert tool.markdown_words(source) == (8, 6)
