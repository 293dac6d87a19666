"""``python -m fx_precision.tools.cli``: the CLI, as ``fx-precision`` and ``python -m fx_precision`` run it."""

import sys

from fx_precision.tools.cli import main

sys.exit(main())
