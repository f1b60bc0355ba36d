"""``python -m offremat``: the same command line as ``offremat``."""

import sys

from offremat.cli import main

sys.exit(main())
