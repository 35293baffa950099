"""A figure with sliders that works in the static HTML book as well as in JupyterLab.

A slider whose ``observe`` callback redraws a matplotlib figure needs a running kernel: in the
HTML book (no kernel) it moves and the picture stays put. Here every picture is drawn once,
for a small grid of slider values, and the sliders select among them in the browser: each
slider's ``index`` is linked (``jslink``, which the widget manager runs in JavaScript) to the
``selected_index`` of a ``Stack`` of images. With two sliders the stacks nest: the outer stack
follows the first slider, and every inner stack follows the second. Nothing runs in Python
after the cell, so the same widget works in the book, in JupyterLab and in a saved notebook.

Each picture is an ``<img>`` in an ``HTML`` widget rather than an ``Image`` widget, so that it
carries alt text (``Image`` has no ``alt``): the ``alt`` given, followed by the slider values
that picture shows. The ``<img>`` keeps the class ``widget-image`` that pages and tests look for.
A ``caption`` is shown under the pictures, as a figure's caption is.

The price is a grid, not a continuum: keep it to a few values per slider (the product of the
counts is the number of PNGs stored in the notebook; :func:`slider_figure` refuses more than
``max_pictures``).
"""

from __future__ import annotations

import base64
import html
import io
import itertools
from collections.abc import Callable, Sequence
from typing import Any

LIVE_NOTE = (
    "Drawn in advance for the values on the sliders, so it works in the HTML book too; "
    "under `make lab` you can change the grid and re-run the cell."
)


def png_of(fig: Any, dpi: int = 100) -> bytes:
    """The figure as PNG bytes, closed afterwards (so nothing is also printed into the cell)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


def picture_html(png: bytes, alt: str) -> str:
    """An ``<img>`` showing ``png`` inline (a data URI) with ``alt`` as its alt text, escaped."""
    data = base64.b64encode(png).decode("ascii")
    return (
        f'<img class="widget-image" alt="{html.escape(alt, quote=True)}" '
        f'src="data:image/png;base64,{data}" style="max-width: 100%; height: auto">'
    )


def slider_figure(
    render: Callable[..., bytes],
    grid: dict[str, Sequence[float]],
    *,
    value: dict[str, float] | None = None,
    fmt: str = "{:.3g}",
    max_pictures: int = 40,
    note: str | None = LIVE_NOTE,
    caption: str | None = None,
    alt: str | None = None,
) -> Any:
    """A VBox of one ``SelectionSlider`` per entry of ``grid`` above the matching picture.

    ``render(**values)`` returns PNG bytes for one combination of slider values (keyword
    arguments named as ``grid``'s keys). Every combination is rendered now, in ``grid``'s
    order; ``value`` picks the combination shown first (default: each slider's first value).
    The sliders are labelled with their key and show their value with ``fmt``; the box's
    ``links`` attribute lists the browser-side links (slider index -> stack).

    Every picture is an ``<img>`` whose alt text is ``alt`` (what the figure shows) followed
    by that picture's slider values, e.g. ``"Bucket sizes (bucket_cap_mb = 25)"``; without
    ``alt`` it names the values only. ``caption`` (plain text, escaped) is shown under the
    pictures and above ``note``. Raises ``ValueError`` for no or more than two sliders, an
    empty slider, or more than ``max_pictures`` pictures, before anything is drawn.
    """
    import ipywidgets as widgets

    names = list(grid)
    if not 1 <= len(names) <= 2:
        raise ValueError(f"slider_figure takes one or two sliders, got {names}")
    counts = [len(grid[n]) for n in names]
    if min(counts) < 1:
        raise ValueError(
            f"every slider needs at least one value: {dict(zip(names, counts, strict=True))}"
        )
    total = 1
    for c in counts:
        total *= c
    if total > max_pictures:
        raise ValueError(
            f"{total} pictures for sliders {dict(zip(names, counts, strict=True))}: more than "
            f"max_pictures={max_pictures}; take fewer values per slider"
        )
    start = value or {}
    index = {n: list(grid[n]).index(start[n]) if n in start else 0 for n in names}

    def picture(combo: tuple[float, ...]) -> Any:
        values = ", ".join(f"{n} = {fmt.format(v)}" for n, v in zip(names, combo, strict=True))
        text = f"{alt} ({values})" if alt else f"Figure for {values}"
        png = render(**dict(zip(names, combo, strict=True)))
        return widgets.HTML(picture_html(png, text))

    images = {combo: picture(combo) for combo in itertools.product(*(grid[n] for n in names))}
    style = {"description_width": "initial"}
    sliders = [
        widgets.SelectionSlider(
            options=[(fmt.format(v), i) for i, v in enumerate(grid[n])],
            value=index[n],
            description=n,
            style=style,
            continuous_update=True,
            layout=widgets.Layout(width="min(600px, 100%)"),
        )
        for n in names
    ]
    links = []  # kept on the box: the book's tests check what drives what
    if len(names) == 1:
        outer = widgets.Stack(list(images.values()), selected_index=index[names[0]])
        links.append(widgets.jslink((sliders[0], "index"), (outer, "selected_index")))
    else:
        inner = [
            widgets.Stack([images[(a, b)] for b in grid[names[1]]], selected_index=index[names[1]])
            for a in grid[names[0]]
        ]
        for stack in inner:
            links.append(widgets.jslink((sliders[1], "index"), (stack, "selected_index")))
        outer = widgets.Stack(inner, selected_index=index[names[0]])
        links.append(widgets.jslink((sliders[0], "index"), (outer, "selected_index")))
    children: list[Any] = [*sliders, outer]
    if caption:
        children.append(widgets.HTML(f'<p class="slider-caption">{html.escape(caption)}</p>'))
    if note:
        children.append(
            widgets.HTML(f"<small>{note.replace('`make lab`', '<code>make lab</code>')}</small>")
        )
    box = widgets.VBox(children)
    box.links = links
    return box
