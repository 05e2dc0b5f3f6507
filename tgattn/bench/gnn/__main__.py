"""``python -m tgattn.bench.gnn``: runs :func:`tgattn.bench.gnn.command.main`."""
import sys

from .command import main

if __name__ == "__main__":
    sys.exit(main())
