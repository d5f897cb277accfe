"""The producer process: `python workers/produce.py ARGS` is `streampack produce ARGS`.

Its code is `streampack.service.producer`. This folder holds only the entry points of the
processes a deployment starts, run by path from a checkout; nothing in it is installed
or importable (docs/architecture.md says why).
"""

import sys

from streampack.cli import main

if __name__ == "__main__":
    sys.exit(main(["produce", *sys.argv[1:]]))
