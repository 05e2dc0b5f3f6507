"""Deprecated path of :mod:`tgattn.verify.reference`."""
from ._lazy import moved

__getattr__ = moved(__name__, "tgattn.verify.reference")
