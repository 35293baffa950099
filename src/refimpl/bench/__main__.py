"""``python -m refimpl.bench NAME [--out DIR] ...``: run one benchmark module."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import refimpl.bench


def available() -> list[str]:
    """Names of the benchmark modules (each has a ``main(argv)``)."""
    return sorted(
        m.name for m in pkgutil.iter_modules(refimpl.bench.__path__) if not m.name.startswith("_")
    )


def main(argv: list[str]) -> int:
    """Run the benchmark ``argv[0]`` with the rest of ``argv``; return its exit status.

    ``-h``/``--help`` prints the usage and exits 0 (``NAME --help`` gives a benchmark's own
    options); no name or an unknown one prints the usage and returns 2, like argparse.
    """
    names = available()
    usage = f"usage: python -m refimpl.bench {{{','.join(names)}}} --out DIR [options]"
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        print("Run `python -m refimpl.bench NAME --help` for one benchmark's options.")
        return 0
    if not argv or argv[0] not in names:
        print(usage)
        return 2
    module = importlib.import_module(f"refimpl.bench.{argv[0]}")
    return int(module.main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
