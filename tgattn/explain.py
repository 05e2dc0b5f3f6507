"""Deprecated path of :mod:`tgattn.nn.explain`."""
from ._lazy import moved

__getattr__ = moved(__name__, "tgattn.nn.explain")
