"""Lazy exports (PEP 562): a package names its public objects, each imported on first use.

``import tgattn`` (and ``python -m tgattn.lm --help``) then costs no torch or PyG import; the
first ``tgattn.GraphAttention`` imports :mod:`tgattn.nn.attention` and keeps the result.
"""
from __future__ import annotations

import importlib
import sys
from typing import Callable, Dict, List, Tuple


def lazy_exports(package: str, exports: Dict[str, str]) -> Tuple[Callable[[str], object], Callable[[], List[str]]]:
    """``(__getattr__, __dir__)`` for ``package``.

    Args:
        package: the package's ``__name__``.
        exports: public name -> the submodule (relative to ``package``) that defines it; a
            name equal to its submodule's is the submodule itself. Other submodules are
            imported on attribute access too (``tgattn.engine``), as an eager package did.

    Example:
        >>> getattr_, dir_ = lazy_exports("json", {"JSONDecoder": "decoder", "scanner": "scanner"})
        >>> getattr_("JSONDecoder").__name__, getattr_("scanner").__name__, "JSONDecoder" in dir_()
        ('JSONDecoder', 'json.scanner', True)
    """

    def __getattr__(name: str):
        if name.startswith("_"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        target = exports.get(name, name)
        try:
            module = importlib.import_module(f"{package}.{target}")
        except ModuleNotFoundError as err:
            if err.name != f"{package}.{target}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = module if target == name else getattr(module, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> List[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__

