"""``python -m safepoint.cli``: the same command line as the ``safepoint`` script."""

from safepoint.cli.main import main

raise SystemExit(main())
