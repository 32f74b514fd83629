"""``python -m reference_server``: the same as ``kvclient serve``."""

import sys

from .simulated.cli import main

if __name__ == "__main__":
    sys.exit(main())
