"""``python -m ferro`` runs the ``ferro`` command line."""

import sys

from ferro.tools.cli import main

sys.exit(main())
