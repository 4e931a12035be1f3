"""``python -m quire.entrypoints.cli``: the same as the ``quire`` console script."""

from quire.entrypoints.cli import main

raise SystemExit(main())
