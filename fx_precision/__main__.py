import sys

from fx_precision.cli import main

sys.exit(main())
