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
