"""``python -m tokenpipe ...``: the same command line as the ``tokenpipe`` console script.
The supervisor starts its children this way, so they never depend on the installed script."""

import sys

from tokenpipe.cli import main

sys.exit(main())
