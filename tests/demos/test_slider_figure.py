"""refimpl.demos.slider_figure: every grid point is drawn once, the sliders start where asked,
and each slider is linked in the browser to the stacks it drives (no Python callback)."""

from __future__ import annotations

import base64
import html.parser
from typing import Any

import pytest

from refimpl.demos.slider_figure import png_of, slider_figure


def _fake_png(**values: float) -> bytes:
    return repr(sorted(values.items())).encode()


class _Imgs(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.imgs: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.imgs.append(dict(attrs))


def _img(widget: Any) -> dict[str, str | None]:
    """The one ``<img>`` a picture widget shows, its attributes parsed as a browser would."""
    parser = _Imgs()
    parser.feed(widget.value)
    assert len(parser.imgs) == 1, widget.value
    return parser.imgs[0]


def _png(widget: Any) -> bytes:
    src = _img(widget)["src"]
    assert src is not None and src.startswith("data:image/png;base64,")
    return base64.b64decode(src.split(",", 1)[1])


def test_one_slider_selects_among_its_pictures_in_the_browser() -> None:
    box = slider_figure(_fake_png, {"cap": [1.0, 5.0, 25.0]}, value={"cap": 25.0}, note=None)
    slider, stack = box.children
    assert [label for label, _ in slider.options] == ["1", "5", "25"]
    assert slider.index == 2 and stack.selected_index == 2
    assert [_png(img) for img in stack.children] == [_fake_png(cap=v) for v in (1.0, 5.0, 25.0)]
    assert [(link.source, link.target) for link in box.links] == [
        ((slider, "index"), (stack, "selected_index"))
    ]


def test_two_sliders_nest_stacks_and_the_second_drives_every_inner_stack() -> None:
    box = slider_figure(_fake_png, {"a": [1, 2], "b": [10, 20, 30]}, value={"b": 20})
    first, second, outer, note = box.children
    assert "make lab" in note.value
    assert outer.selected_index == 0 and len(outer.children) == 2
    for a, inner in zip([1, 2], outer.children, strict=True):
        assert inner.selected_index == 1
        assert [_png(img) for img in inner.children] == [_fake_png(a=a, b=b) for b in (10, 20, 30)]
    pairs = [(link.source[0], link.target[0]) for link in box.links]
    assert (first, outer) in pairs
    assert all((second, inner) in pairs for inner in outer.children)
    assert len(pairs) == 3
    assert all(k.source[1] == "index" and k.target[1] == "selected_index" for k in box.links)


def test_every_picture_has_alt_text_naming_its_values_and_the_caption_shows_below() -> None:
    box = slider_figure(
        _fake_png,
        {"a": [1, 2], "b": [10, 20]},
        caption='Time per step <falls> as "a" grows',
        alt="Bars of step time & overlap",
    )
    _first, _second, outer, caption, note = box.children
    assert "make lab" in note.value
    # The caption is escaped text under the pictures, not markup.
    assert "Time per step &lt;falls&gt; as &quot;a&quot; grows" in caption.value
    alts = [_img(img)["alt"] for inner in outer.children for img in inner.children]
    assert alts == [
        f"Bars of step time & overlap (a = {a}, b = {b})" for a in (1, 2) for b in (10, 20)
    ]
    # Pages and the browser tests find the pictures by this class.
    assert all("widget-image" in (_img(img)["class"] or "") for img in outer.children[0].children)


def test_without_alt_every_picture_still_names_its_values() -> None:
    box = slider_figure(_fake_png, {"cap": [1.0, 5.0]}, note=None)
    _slider, stack = box.children  # no caption widget when none is given
    assert [_img(img)["alt"] for img in stack.children] == [
        "Figure for cap = 1",
        "Figure for cap = 5",
    ]


def test_a_grid_too_large_or_empty_is_refused_before_drawing() -> None:
    drawn: list[dict[str, float]] = []

    def render(**values: float) -> bytes:
        drawn.append(values)
        return b""

    with pytest.raises(ValueError, match="max_pictures=40"):
        slider_figure(render, {"a": range(7), "b": range(7)})
    with pytest.raises(ValueError, match="at least one value"):
        slider_figure(render, {"a": []})
    with pytest.raises(ValueError, match="one or two sliders"):
        slider_figure(render, {"a": [1], "b": [1], "c": [1]})
    assert drawn == []


def test_png_of_returns_a_png_and_closes_the_figure() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1])
    assert fig.number in plt.get_fignums()
    data = png_of(fig)
    # this figure is closed (another test in the same process may have left its own open)
    assert data.startswith(b"\x89PNG") and fig.number not in plt.get_fignums()
