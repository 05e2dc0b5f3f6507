"""``python -m tgattn.bench.engine_scaling``: runs :func:`tgattn.bench.engine_scaling.command.main`."""
import sys

from .command import main

if __name__ == "__main__":
    sys.exit(main())
