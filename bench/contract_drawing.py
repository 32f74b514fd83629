"""Draws the admission contract's two halves (docs/img/contract.svg), so it can be redrawn.

python bench/contract_drawing.py [--out docs/img/contract.svg]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _plots import draw_contract

DEFAULT = Path(__file__).resolve().parents[1] / "docs" / "img" / "contract.svg"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT, help="an .svg (or .png) path")
    draw_contract(parser.parse_args().out)


if __name__ == "__main__":
    main()
