"""``python -m tgattn.bench.gpu``: runs :func:`tgattn.bench.gpu.command.main`."""
import sys

from .command import main

if __name__ == "__main__":
    sys.exit(main())
