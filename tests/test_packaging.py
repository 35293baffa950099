"""What a user installs is honest: the licence text ships, there is one version, the torch
bound is the one CI tests, and the README tells users to install torch before refimpl."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import tomllib

import refimpl

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_licence_text_ships_and_matches_the_declared_licence() -> None:
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_one_version_source() -> None:
    config = _pyproject()
    assert "version" not in config["project"] and "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "refimpl.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", refimpl.__version__)


def test_the_torch_lower_bound_is_the_version_ci_tests() -> None:
    pinned = re.search(r"^torch==(\d+\.\d+)\.\d+$", (ROOT / "requirements.txt").read_text(), re.M)
    assert pinned is not None
    torch_dep = next(d for d in _pyproject()["project"]["dependencies"] if d.startswith("torch"))
    assert torch_dep == f"torch>={pinned.group(1)}"


def test_readme_installs_torch_before_refimpl_and_the_package_has_its_own_description() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.index("pip install torch==") < readme.index("pip install -e .")
    package_readme = ROOT / _pyproject()["project"]["readme"]
    assert package_readme.exists() and package_readme != ROOT / "README.md"
    assert "make test" not in package_readme.read_text()  # users' page, not developers'


def test_build_outputs_are_ignored_so_installing_from_a_path_leaves_git_clean() -> None:
    ignored = (ROOT / ".gitignore").read_text().split()
    assert "build/" in ignored and "dist/" in ignored and "*.egg-info/" in ignored


def test_both_readmes_show_the_install_that_works_from_a_clone() -> None:
    """refimpl is not on PyPI: ``pip install refimpl`` fails (or installs someone else's
    package). Both READMEs install torch first (with the CPU index line for CPU-only
    machines), then refimpl from the clone."""
    cpu = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    for readme in (ROOT / "README.md", ROOT / _pyproject()["project"]["readme"]):
        text = readme.read_text()
        assert not re.search(r"pip install refimpl\b", text), readme
        assert text.index("pip install torch==") < text.index("pip install -e ."), readme
        assert cpu in text and "not on PyPI" in text, readme
