"""Deprecated path of :mod:`tgattn.nn.conv`."""
from ._lazy import moved

__getattr__ = moved(__name__, "tgattn.nn.conv")
