"""Command line: ``python -m tgattn <command>``.

Its help, argument errors and unknown commands come from argparse before torch or PyG is
imported (``import tgattn`` is lazy, and so is :mod:`tgattn.analysis.show`, which describes
show's arguments): each command imports what it runs once its arguments parse.
"""
from __future__ import annotations

import argparse
import sys

from ._cli import BACKENDS, missing_plot_extra, run
from .analysis.fidelity_command import DESCRIPTION as FIDELITY, add_arguments as fidelity_arguments
from .analysis.show import add_arguments as show_arguments

DESCRIPTION = ("tgattn's commands: check that graph attention equals dense attention on this machine, "
               "compile the fused C++ kernel ahead of the first call, draw which tokens influence a token, or "
               "measure what sparse patterns cost a trained model.")
VERIFY = ("Check, on this machine, that graph attention equals dense attention: one case per builder family "
          "(float64, 4 heads), outputs and input gradients against the dense oracle within 1e-10. Prints one line "
          "per case; exit status 1 if any case fails. Compiles the fused C++ kernel first if it is not built yet "
          "(see the build command).")
BUILD = ("Compile tgattn's fused C++ kernel now, so that no later float32 / float64 call waits for it (with "
         "--half, no float16 / bfloat16 call either): prints what is being built and its progress, then the time "
         "it took. Does nothing when it is built for this source and this torch already.")
SHOW = ("Draw which tokens influence a token: attention, rollout and flow over the layers of random graph "
        "attention layers, a tiny GPT checkpoint (--checkpoint) or a transformers model (--hf). Writes a picture "
        "(--out) and prints the token's top influencers, or writes an interactive HTML page (--html): hover a "
        "token to see what it attends to and what influences it.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", allow_abbrev=False, help="check graph attention against dense attention on every builder",
                                 description=VERIFY)
    verify.add_argument("--backend", default="auto", choices=BACKENDS, help="attention backend to verify (default: auto)")
    build = commands.add_parser("build", allow_abbrev=False, help="compile the fused C++ kernel now (a no-op when built)",
                                description=BUILD)
    build.add_argument("--half", action="store_true",
                       help="also its float16 / bfloat16 part (else compiled by the first such call)")
    show = commands.add_parser("show", allow_abbrev=False, help="draw which tokens influence a token (attention, rollout, flow)",
                               description=SHOW)
    show_arguments(show)
    fidelity = commands.add_parser("fidelity", allow_abbrev=False, help="what each sparse pattern costs a trained model (fidelity study)",
                                   description=FIDELITY)
    fidelity_arguments(fidelity)
    args = parser.parse_args(argv)
    if args.command == "verify":
        from .verify import main as verify_main

        return verify_main(backend=args.backend)
    if args.command == "build":
        from .engine.build import EXTENSIONS, FUSED, prebuild

        try:
            prebuild(EXTENSIONS if args.half else (FUSED,), progress=True)
        except RuntimeError as err:  # what stopped it, in one line (a compiler's errors follow on their own lines)
            print(f"{build.prog}: error: {err}", file=sys.stderr)
            return 1
        return 0
    if args.command == "fidelity":
        from .analysis.fidelity_command import main as fidelity_main

        if missing_plot_extra():  # before any work: the frontier is drawn last
            fidelity.error(missing_plot_extra())
        return run(fidelity, fidelity_main, args)
    from .analysis.show import main as show_main

    if missing_plot_extra() and not args.html:  # before any work; the page needs no matplotlib
        show.error(missing_plot_extra())
    return run(show, show_main, args)


if __name__ == "__main__":
    sys.exit(main())
