"""The producer and its supervised workers: `python workers/serve.py ARGS` is `streampack serve`.

Its code is `streampack.service.serve`. This folder holds only the entry points of the
processes a deployment starts, run by path from a checkout; nothing in it is installed
or importable (docs/architecture.md says why).
"""

import sys

from streampack.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
