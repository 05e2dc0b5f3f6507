"""Command line: ``python -m tgattn <command>``."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tgattn", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="check graph attention against dense attention on every builder")
    verify.add_argument("--backend", default="auto", help="attention backend to verify (default: auto)")
    show = commands.add_parser("show", help="draw which tokens influence a token (attention, rollout, flow)")
    from .analysis.show import add_arguments as show_arguments

    show_arguments(show)
    args = parser.parse_args(argv)
    if args.command == "verify":
        from .verify import main as verify_main

        return verify_main(backend=args.backend)
    if args.command == "show":
        from .analysis.show import main as show_main

        return show_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
