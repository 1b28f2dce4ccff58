"""``python -m flashckpt``: the command line, as the ``flashckpt`` script runs it."""

import sys

from flashckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
