"""The committed diagrams under book/figures/diagrams are what refimpl.demos.diagrams draws.

Each diagram is regenerated into a temporary folder and compared byte for byte with the
committed SVG, so a drawing changed without `python -m refimpl.demos.diagrams` fails here; and
every diagram is placed in its chapter as a captioned figure with alt text."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from refimpl.demos import diagrams

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / diagrams.DEFAULT_OUT
# Diagrams drawn but not yet in a chapter (none today); their files are still checked.
NOT_PLACED_YET: set[str] = set()


@pytest.mark.parametrize("diagram", diagrams.DIAGRAMS, ids=lambda d: d.name)
def test_the_committed_svg_is_what_the_code_draws(
    diagram: diagrams.Diagram, tmp_path: Path
) -> None:
    fresh = diagrams.write_svg(diagram.draw(), tmp_path / f"{diagram.name}.svg")
    committed = COMMITTED / fresh.name
    assert committed.exists(), f"{committed} is missing: run python -m refimpl.demos.diagrams"
    assert fresh.read_bytes() == committed.read_bytes(), (
        f"{committed.name} differs from what {diagram.draw.__name__} draws: run "
        "python -m refimpl.demos.diagrams and commit the result"
    )


def test_two_runs_write_the_same_bytes(tmp_path: Path) -> None:
    """The comparison above is meaningful only if drawing is deterministic."""
    first = [p.read_bytes() for p in diagrams.write_all(tmp_path / "a")]
    second = [p.read_bytes() for p in diagrams.write_all(tmp_path / "b")]
    assert first == second
    assert all(b.startswith(b"<?xml") and b"<svg" in b and b"<path" in b for b in first)
    assert not any(b"<dc:date>" in b for b in first), "a date in the SVG changes every run"


def test_every_committed_diagram_is_drawn_by_the_code() -> None:
    names = {f"{d.name}.svg" for d in diagrams.DIAGRAMS}
    assert {p.name for p in COMMITTED.glob("*.svg")} == names


def test_the_cli_writes_every_diagram(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert diagrams.main(["--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{d.name}.svg" for d in diagrams.DIAGRAMS
    )
    assert len(capsys.readouterr().out.splitlines()) == len(diagrams.DIAGRAMS)


def _crowded_text(fig: Figure) -> list[str]:
    """Texts that leave the figure, overflow the box they sit in, or overlap another text."""
    renderer = FigureCanvasAgg(fig).get_renderer()
    ax = fig.axes[0]
    boxes = [p.get_window_extent(renderer) for p in ax.patches if isinstance(p, FancyBboxPatch)]
    texts = [(t.get_text(), t.get_window_extent(renderer)) for t in ax.texts if t.get_text()]
    found = []
    for text, tb in texts:
        if tb.x0 < 0 or tb.y0 < 0 or tb.x1 > fig.bbox.width or tb.y1 > fig.bbox.height:
            found.append(f"{text!r} leaves the figure")
        cx, cy = (tb.x0 + tb.x1) / 2, (tb.y0 + tb.y1) / 2
        for bb in boxes:
            inside = tb.x0 >= bb.x0 + 2 and tb.x1 <= bb.x1 - 2 and bb.y0 <= tb.y0 <= tb.y1 <= bb.y1
            if bb.contains(cx, cy) and not inside:
                found.append(f"{text!r} overflows its box")
    found += [
        f"{a!r} overlaps {b!r}"
        for i, (a, ab) in enumerate(texts)
        for b, bb in texts[i + 1 :]
        if ab.overlaps(bb)
    ]
    return found


@pytest.mark.parametrize("diagram", diagrams.DIAGRAMS, ids=lambda d: d.name)
def test_no_text_overflows_its_box_or_the_figure(diagram: diagrams.Diagram) -> None:
    """The type is large enough for a phone only if the layout still holds it."""
    assert _crowded_text(diagram.draw()) == []


def test_the_crowding_check_catches_an_overflow() -> None:
    fig = diagrams.draw_atomic_save()
    fig.axes[0].texts[-1].set_fontsize(40)  # the footnote, now wider than the figure
    assert any("leaves the figure" in f for f in _crowded_text(fig))


_FIGURE = re.compile(
    r"```\{figure\} \.\./book/figures/diagrams/(?P<file>[\w.]+)\n"
    r"(?P<options>(?::[^\n]*\n)+)\n(?P<caption>.+?)\n```",
    re.DOTALL,
)


@pytest.mark.parametrize(
    "diagram",
    [d for d in diagrams.DIAGRAMS if d.name not in NOT_PLACED_YET],
    ids=lambda d: d.name,
)
def test_each_diagram_is_a_captioned_figure_in_its_chapter(diagram: diagrams.Diagram) -> None:
    """A markdown cell of its chapter holds a MyST figure: name fig-chNN-..., alt text, a
    caption that says more than the alt text."""
    (path,) = (ROOT / "notebooks").glob(f"{diagram.chapter:02d}_*.ipynb")
    cells = nbformat.read(path, as_version=4).cells
    found = [
        m
        for c in cells
        if c.cell_type == "markdown"
        for m in _FIGURE.finditer(c.source)
        if m.group("file") == f"{diagram.name}.svg"
    ]
    assert len(found) == 1, f"{path.name}: {len(found)} figures of {diagram.name}.svg"
    options = dict(line[1:].split(": ", 1) for line in found[0].group("options").splitlines())
    assert re.fullmatch(rf"fig-ch{diagram.chapter:02d}-[a-z0-9-]+", options.get("name", ""))
    alt, caption = options.get("alt", ""), found[0].group("caption").strip()
    assert len(alt) > 40 and len(caption) > 40, f"{path.name}: {diagram.name}: alt/caption"
    assert alt != caption
