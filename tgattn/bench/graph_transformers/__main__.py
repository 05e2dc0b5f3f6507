"""``python -m tgattn.bench.graph_transformers``: runs :func:`tgattn.bench.graph_transformers.command.main`."""
import sys

from .command import main

if __name__ == "__main__":
    sys.exit(main())
