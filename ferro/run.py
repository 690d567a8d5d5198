"""``python -m ferro.run``: the same as ``ferro run``."""

import sys

from ferro.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
