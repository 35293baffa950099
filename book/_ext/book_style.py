"""Two reading fixes made while Sphinx builds the book.

1. The API pages show a class's bases only when they say something: ``Bases: object`` on
   every plain class is noise, while ``Bases: WorkerError, TimeoutError`` tells the reader
   what to catch. ``show-inheritance`` stays on; it is dropped for classes whose only base is
   ``object``.
2. Citations read author-year in round brackets, "(Daly, 2006)", not pybtex's alpha labels
   "[Dal06]". The bibliography is labelled author-year (the formatting style
   ``plain_author_year``, the book's ``bibtex_default_style``) and a citation shows its label
   in round brackets (``author_year_round``, the book's ``bibtex_reference_style``). Using
   the label, rather than sphinxcontrib-bibtex's ``author_year`` style, keeps two sources of
   one author and year apart ("PyTorch contributors, 2025a" and "..., 2025b"), as in the list.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pybtex.plugin
import sphinxcontrib.bibtex.plugin
from pybtex.richtext import Text
from pybtex.style.formatting.plain import Style as PlainStyle
from pybtex.style.labels import BaseLabelStyle
from sphinx.ext.autodoc import ClassDocumenter, Options
from sphinxcontrib.bibtex.style.referencing import BracketStyle
from sphinxcontrib.bibtex.style.referencing.label import LabelReferenceStyle


class _ClassDocumenter(ClassDocumenter):
    """autodoc's class documenter, without the ``Bases: object`` line."""

    def add_directive_header(self, sig: str) -> None:
        if getattr(self.object, "__bases__", ()) != (object,) or not self.options.show_inheritance:
            super().add_directive_header(sig)
            return
        # the options are shared with the sibling documenters: change a copy, for this class only
        shared = self.options
        self.options = Options(shared)
        self.options["show-inheritance"] = False
        try:
            super().add_directive_header(sig)
        finally:
            self.options = shared


def _round() -> BracketStyle:
    return BracketStyle(left="(", right=")", sep="; ")


@dataclasses.dataclass
class _AuthorYearRound(LabelReferenceStyle):
    """The label (author and year) in round brackets; several sources separated by "; "."""

    bracket_parenthetical: BracketStyle = dataclasses.field(default_factory=_round)
    bracket_textual: BracketStyle = dataclasses.field(default_factory=_round)
    bracket_author: BracketStyle = dataclasses.field(default_factory=_round)
    bracket_label: BracketStyle = dataclasses.field(default_factory=_round)
    bracket_year: BracketStyle = dataclasses.field(default_factory=_round)


sphinxcontrib.bibtex.plugin.register_plugin(
    "sphinxcontrib.bibtex.style.referencing", "author_year_round", _AuthorYearRound
)


def _names(entry: Any) -> str:
    persons = entry.persons.get("author") or entry.persons.get("editor") or []
    last = [
        Text.from_latex(" ".join(p.prelast_names + p.last_names)).render_as("text") for p in persons
    ]
    if len(last) >= 3 or (len(last) == 2 and last[1] == "others"):
        return f"{last[0]} et al."
    return " and ".join(last) or entry.key


class _AuthorYearLabels(BaseLabelStyle):  # type: ignore[misc]
    """Bibliography labels as the citations read: "Daly, 2006", "PyTorch contributors, n.d."."""

    def format_labels(self, sorted_entries: Any) -> Any:
        labels = [f"{_names(e)}, {e.fields.get('year', 'n.d.')}" for e in sorted_entries]
        for label in labels:
            twins = [i for i, other in enumerate(labels) if other == label]
            if len(twins) > 1:  # the same author and year twice: 2025a, 2025b, ...
                dash = "-" if label.endswith("n.d.") else ""  # "n.d.-a", as APA writes it
                for n, i in enumerate(twins):
                    labels[i] = f"{label}{dash}{chr(ord('a') + n)}"
        yield from labels


class _PlainAuthorYear(PlainStyle):  # type: ignore[misc]
    """pybtex's plain style, sorted by author and year, labelled as the citations read."""

    default_label_style = "author_year"
    default_sorting_style = "author_year_title"


pybtex.plugin.register_plugin("pybtex.style.labels", "author_year", _AuthorYearLabels)
pybtex.plugin.register_plugin("pybtex.style.formatting", "plain_author_year", _PlainAuthorYear)


def setup(app: Any) -> dict[str, Any]:
    app.setup_extension("sphinx.ext.autodoc")
    app.add_autodocumenter(_ClassDocumenter, override=True)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
