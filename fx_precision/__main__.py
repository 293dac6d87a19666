import sys

from fx_precision.tools.cli import main

sys.exit(main())
