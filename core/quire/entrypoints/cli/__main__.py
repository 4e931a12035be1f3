"""``python -m quire.entrypoints.cli``: the same as the ``quire`` console script."""

from quire.entrypoints.launch import main

raise SystemExit(main())
