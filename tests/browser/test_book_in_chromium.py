"""Open every page of the built book in headless Chromium and check what a reader sees.

Run after `make book`: `make browser-test`. Uses Debian's chromium (apt-get install chromium),
driven by Playwright for Python; no browser is downloaded. Screenshots go to
_build/screenshots/.
"""

from __future__ import annotations

import functools
import http.server
import re
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
HTML = ROOT / "_build" / "html"
SHOTS = ROOT / "_build" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
# The book theme logs exactly this harmless error on every page; anything else fails.
ALLOWED_CONSOLE_ERRORS = ("Got invalid theme mode",)


def _toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [chapter["file"] for chapter in part["chapters"]]
    return files


def _all_pages() -> list[str]:
    """Every page the book builds: the chapters and, under them, their sections (API pages)."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    pages, todo = [toc["root"]], [c for part in toc.get("parts", []) for c in part["chapters"]]
    while todo:
        entry = todo.pop(0)
        pages.append(entry["file"])
        todo[:0] = entry.get("sections", [])
    return pages


def _expected(doc: str) -> tuple[str, int, int]:
    """The page's title, how many figures and how many widgets its source has."""
    nb_path = ROOT / f"{doc}.ipynb"
    if nb_path.exists():
        nb = nbformat.read(nb_path, as_version=4)
        title = nb.cells[0].source.splitlines()[0].lstrip("# ").strip().replace("`", "")
        outputs = [o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs]
        figures = sum("image/png" in data for data in outputs)
        widgets = sum("application/vnd.jupyter.widget-view+json" in data for data in outputs)
        return title, figures, widgets
    text = (ROOT / f"{doc}.md").read_text()
    title = text.splitlines()[0].lstrip("# ").strip().replace("`", "")  # code spans render bare
    return title, len(re.findall(r"!\[", text)), 0


SIDEWAYS_JS = """() => {
  const out = [];
  for (const el of document.querySelectorAll(
      'article pre, article div.highlight, article div.cell_output, article table')) {
    if (el.scrollWidth > el.clientWidth + 1) {
      out.push(`${el.scrollWidth}/${el.clientWidth} ${(el.innerText || '').slice(0, 50)}`);
    }
  }
  return out;
}"""
UNCAPTIONED_JS = """() => Array.from(document.querySelectorAll('article div.cell_output img'))
  .filter(img => !img.closest('.jupyter-widgets'))
  .filter(img => !(img.getAttribute('alt') || '').trim()
    || !(img.closest('figure')?.querySelector('figcaption')?.innerText || '').trim())
  .map(img => (img.getAttribute('src') || '').slice(0, 60))"""
LINKS_JS = """() => Array.from(document.querySelectorAll('article a[href]'))
  .map(a => a.href).filter(h => h.startsWith(location.origin))"""


@functools.cache
def _ids(path: Path) -> frozenset[str]:
    return frozenset(re.findall(r'\bid="([^"]+)"', path.read_text(errors="replace")))


def _resolves(href: str) -> bool:
    """Whether a link to this server names a built page (and an element on it, for #x)."""
    url = urllib.parse.urlsplit(href)
    target = HTML / urllib.parse.unquote(url.path).lstrip("/")
    if target.is_dir():
        target = target / "index.html"
    if not target.is_file():
        return False
    fragment = urllib.parse.unquote(url.fragment)
    return not fragment or target.suffix != ".html" or fragment in _ids(target)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # one line per file is noise
        pass


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    if not (HTML / "index.html").exists():
        pytest.fail("the book is not built: run `make book` first", pytrace=False)
    handler = functools.partial(_QuietHandler, directory=str(HTML))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def browser():  # type: ignore[no-untyped-def]
    playwright = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} missing: apt-get install -y chromium", pytrace=False)
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("doc", _toc_files())
def test_page_renders_title_and_figures_without_errors(browser, base_url: str, doc: str) -> None:  # type: ignore[no-untyped-def]
    title, n_figures, n_widgets = _expected(doc)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on(
        "response", lambda r: errors.append(f"HTTP {r.status} {r.url}") if r.status >= 400 else None
    )
    response = page.goto(f"{base_url}/{doc}.html", wait_until="load")
    assert response is not None and response.ok, f"{doc}.html: HTTP {response and response.status}"

    h1 = page.locator("article h1").first.inner_text().replace("\u2019", "'")  # smart quotes
    assert title in h1, f"{doc}: expected title {title!r}, page shows {h1!r}"

    images = page.locator("article img")
    assert images.count() >= n_figures, f"{doc}: {images.count()} images, expected {n_figures}"
    for i in range(images.count()):
        img = images.nth(i)
        img.scroll_into_view_if_needed()
        width = img.evaluate("el => el.complete ? el.naturalWidth : 0")
        assert width > 0, f"{doc}: image {i} ({img.get_attribute('src')}) did not load"

    if n_widgets:
        # Saved widget state is rendered by the vendored html-manager: the widgets must appear.
        page.wait_for_selector("article .jupyter-widgets", timeout=20_000)
        assert page.locator("article .jupyter-widgets").count() >= n_widgets, doc

    # Nothing clipped: no code, output or table scrolls sideways at 1400 px.
    sideways = page.evaluate(SIDEWAYS_JS)
    assert not sideways, f"{doc}: blocks wider than the page (scroll/client px, text): {sideways}"

    # Every link inside the book points at a page that exists, and at an anchor on it.
    broken = [href for href in page.evaluate(LINKS_JS) if not _resolves(href)]
    assert not broken, f"{doc}: links to nothing: {broken}"

    # Every figure a cell draws is a numbered figure with a caption and alt text.
    bare = page.evaluate(UNCAPTIONED_JS)
    assert not bare, f"{doc}: output images without a caption or alt text: {bare}"

    body = page.locator("article").inner_text()
    assert "Traceback (most recent call last)" not in body, f"{doc}: a Python traceback shows"
    assert "Error" not in page.title()

    unexpected = [e for e in errors if not any(a in e for a in ALLOWED_CONSOLE_ERRORS)]
    assert not unexpected, f"{doc}: console errors {unexpected}"

    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{doc.replace('/', '__')}.png"), full_page=True)
    page.close()


# A phone: the page itself never scrolls sideways (a long inline literal breaks; a table or a
# code block too wide for the screen scrolls inside its own box), and code blocks keep their
# lines: each line of code (not of text output, which wraps; code a cell shows through a lexer
# counts as code) is one rendered line (no wrap), so indentation stays readable.
PHONE_JS = """() => {
  const page = document.scrollingElement;
  const wrapped = [];
  const code = Array.from(document.querySelectorAll('article div.highlight pre'))
    .filter(pre => !pre.closest('div.cell_output, div.output')
      || pre.closest('div.highlight-python, div.highlight-diff'));
  for (const pre of code) {
    const style = getComputedStyle(pre);
    const lines = pre.textContent.replace(/\\n$/, '').split('\\n').length;
    const pad = parseFloat(style.paddingTop) + parseFloat(style.paddingBottom);
    const height = pre.clientHeight - pad;
    const rows = Math.round(height / parseFloat(style.lineHeight));
    if (style.whiteSpace !== 'pre' || rows !== lines) {
      wrapped.push(`${lines} lines shown as ${rows} (white-space ${style.whiteSpace}): `
        + pre.textContent.slice(0, 40));
    }
  }
  const scrolling = code.filter(pre => pre.scrollWidth > pre.clientWidth + 1).length;
  return {scrollWidth: page.scrollWidth, clientWidth: page.clientWidth, wrapped, scrolling};
}"""
PHONE_WIDTH = 420


def _widest_on(page) -> str:  # type: ignore[no-untyped-def]
    """What sticks out furthest right on the page (for the failure message)."""
    text: str = page.evaluate(
        """() => {
          let worst = null, right = 0;
          for (const el of document.querySelectorAll('article *')) {
            const r = el.getBoundingClientRect();
            if (r.right > right) { right = r.right; worst = el; }
          }
          return worst ? `${Math.round(right)} px: <${worst.tagName.toLowerCase()}> `
            + (worst.textContent || '').slice(0, 60) : '';
        }"""
    )
    return text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("doc", _all_pages())
def test_page_fits_a_phone_and_code_blocks_keep_their_lines(
    browser, base_url: str, doc: str
) -> None:  # type: ignore[no-untyped-def]
    page = browser.new_page(viewport={"width": PHONE_WIDTH, "height": 900})
    page.goto(f"{base_url}/{doc}.html", wait_until="load")
    phone = page.evaluate(PHONE_JS)
    assert phone["scrollWidth"] <= phone["clientWidth"], (
        f"{doc}: at {PHONE_WIDTH} px the page scrolls sideways ({phone['scrollWidth']} px wide "
        f"in {phone['clientWidth']} px); widest: {_widest_on(page)}"
    )
    assert not phone["wrapped"], (
        f"{doc}: code blocks wrapped at {PHONE_WIDTH} px: {phone['wrapped']}"
    )
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{doc.replace('/', '__')}__phone.png"))
    page.close()


def test_a_code_block_too_wide_for_a_phone_scrolls_inside_itself(browser, base_url: str) -> None:  # type: ignore[no-untyped-def]
    """The check above is not vacuous: chapter 2 has code lines wider than a phone, and they
    scroll inside their block (each still one line) while the page stays put."""
    page = browser.new_page(viewport={"width": PHONE_WIDTH, "height": 900})
    page.goto(f"{base_url}/notebooks/02_ddp_from_the_inside.html", wait_until="load")
    phone = page.evaluate(PHONE_JS)
    assert phone["scrolling"] > 0, "no code block in chapter 2 is wider than a phone"
    assert not phone["wrapped"] and phone["scrollWidth"] <= phone["clientWidth"], phone
    page.close()


# Every search box laid out on the page, on screen or not (the sidebar's counts where it is
# scrolled away or off-canvas on a phone: a reader who opens it sees it).
SEARCH_BOXES_JS = """() => Array.from(document.querySelectorAll(
    '.search-button__button, form.bd-search, input[type=search]'))
  .filter(el => {
    const r = el.getBoundingClientRect();
    return r.width > 0 && r.height > 0 && getComputedStyle(el).visibility !== 'hidden';
  }).map(el => el.className)"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("doc", _toc_files())
def test_one_search_box_and_each_chapter_offers_its_notebook(
    browser, base_url: str, doc: str
) -> None:  # type: ignore[no-untyped-def]
    for width in (1400, PHONE_WIDTH):
        page = browser.new_page(viewport={"width": width, "height": 900})
        page.goto(f"{base_url}/{doc}.html", wait_until="load")
        boxes = page.evaluate(SEARCH_BOXES_JS)
        assert len(boxes) == 1, f"{doc} at {width} px: {len(boxes)} search boxes: {boxes}"
        if (ROOT / f"{doc}.ipynb").exists():
            # The header's download button offers the chapter's notebook, as it is committed.
            name = Path(doc).name + ".ipynb"
            button = page.locator(".article-header-buttons .dropdown-download-buttons > button")
            assert button.is_visible(), f"{doc} at {width} px: no download button"
            link = page.locator(f".dropdown-download-buttons a[href$='/{name}']")
            assert link.count() == 1, f"{doc}: the download menu does not offer {name}"
            href = link.evaluate("a => a.href")
            assert _resolves(href), f"{doc}: the download link {href} leads nowhere"
            target = HTML / urllib.parse.urlsplit(href).path.lstrip("/")
            assert nbformat.read(target, as_version=4).cells, f"{doc}: {target} is no notebook"
        page.close()


# The pictures a widget shows now (a widget may hold one per slider value and show one).
SHOWN_PICTURES_JS = """() => Array.from(document.querySelectorAll('article .widget-image'))
  .filter(img => img.offsetParent !== null).map(img => img.src)"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("doc", [d for d in _toc_files() if _expected(d)[2]])
def test_every_widget_slider_changes_the_picture_in_the_static_page(  # type: ignore[no-untyped-def]
    browser, base_url: str, doc: str
) -> None:
    """No control that does nothing: in the HTML book (no kernel) every slider of a widget
    shows another picture when moved, because the pictures were drawn in advance."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(f"{base_url}/{doc}.html", wait_until="load")
    page.wait_for_selector("article .jupyter-widgets .widget-image", timeout=20_000)
    handles = page.locator("article .jupyter-widgets .noUi-handle")
    assert handles.count() > 0, f"{doc}: a widget without a slider"
    for i in range(handles.count()):
        handle = handles.nth(i)
        handle.scroll_into_view_if_needed()
        before = page.evaluate(SHOWN_PICTURES_JS)
        assert before, f"{doc}: no picture on show next to slider {i}"
        handle.focus()
        for key in ("End", "Home"):  # one of the two moves it, wherever it starts
            page.keyboard.press(key)
            page.wait_for_timeout(300)
            if page.evaluate(SHOWN_PICTURES_JS) != before:
                break
        after = page.evaluate(SHOWN_PICTURES_JS)
        assert after != before, f"{doc}: slider {i} moved, the picture stayed the same"
        assert len(after) == len(before), f"{doc}: slider {i} hid or added a picture"
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{doc.replace('/', '__')}__widgets.png"), full_page=True)
    page.close()
