"""Deprecated path of :mod:`tgattn.nn.attention`."""
from ._lazy import moved

__getattr__ = moved(__name__, "tgattn.nn.attention")
