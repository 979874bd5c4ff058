"""``python -m unickpt``: the same command line as the ``unickpt`` console script."""

from __future__ import annotations

import sys

from unickpt.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
