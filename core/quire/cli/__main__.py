"""``python -m quire.cli``: the same as the ``quire`` console script."""

from quire.cli import main

raise SystemExit(main())
