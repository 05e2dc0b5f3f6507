"""Command line: ``python -m tgattn <command>``."""
from __future__ import annotations

import argparse
import sys

from ._cli import missing_plot_extra, run


def main(argv=None) -> int:
    from .analysis.show import add_arguments as show_arguments
    from .functional import BACKENDS

    parser = argparse.ArgumentParser(prog="python -m tgattn", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="check graph attention against dense attention on every builder")
    verify.add_argument("--backend", default="auto", choices=BACKENDS, help="attention backend to verify (default: auto)")
    show = commands.add_parser("show", help="draw which tokens influence a token (attention, rollout, flow)")
    show_arguments(show)
    args = parser.parse_args(argv)
    if args.command == "verify":
        from .verify import main as verify_main

        return verify_main(backend=args.backend)
    from .analysis.show import main as show_main

    if missing_plot_extra():  # before any work
        show.error(missing_plot_extra())
    return run(show, show_main, args)


if __name__ == "__main__":
    sys.exit(main())
