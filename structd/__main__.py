"""`python -m structd ...` is the `structd` console script."""

import sys

from structd.cli import main

sys.exit(main())
