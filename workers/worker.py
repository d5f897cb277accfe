"""A pack worker process: `python workers/worker.py ARGS` is `streampack worker ARGS`.

Its code is `streampack.service.worker`. This folder holds only the entry points of the
processes a deployment starts, run by path from a checkout; nothing in it is installed
or importable (docs/architecture.md says why).
"""

import sys

from streampack.cli import main

if __name__ == "__main__":
    sys.exit(main(["worker", *sys.argv[1:]]))
