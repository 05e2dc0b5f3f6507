import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("TGATTN_DATA", REPO.parent / "shared" / "data"))

if not torch.cuda.is_available():
    # Without a GPU, the Triton backend's tests run its kernels through Triton's interpreter,
    # which must be chosen before triton (and its own jit library) is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def data_root():
    """The shared data folder (``TGATTN_DATA`` or ``../shared/data``); skips when absent."""
    if not DATA.is_dir():
        message = f"shared data folder not found at {DATA} (set TGATTN_DATA)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI always has ../shared/data: a missing folder is a defect there
        pytest.skip(message)
    return DATA


@pytest.fixture
def cli(capsys):
    """Runs a command line's ``main(argv)`` in process: ``(exit status, stderr)``.

    Parse errors end in ``SystemExit`` (argparse), errors of a running command in a returned
    status; both count.
    """

    def run(main, argv):
        try:
            status = main(argv)
        except SystemExit as exit:
            status = exit.code
        return status, capsys.readouterr().err

    return run


def one_line_error(err: str, prog: str) -> str:
    """The message of the single ``prog: error: ...`` line of ``err`` (usage lines may precede it)."""
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"{prog}: error: ") and err.endswith(errors[0] + "\n"), err
    return errors[0][len(prog) + len(": error: "):]


def command_modules():
    """Every ``python -m`` name of the package, found rather than listed: each module with a
    ``__main__`` guard (a package's ``__main__.py`` stands for the package)."""
    found = []
    for path in sorted((REPO / "tgattn").rglob("*.py")):
        if 'if __name__ == "__main__":' in path.read_text(encoding="utf-8"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__main__" else parts))
    return found
