"""Deprecated path of :mod:`tgattn.datasets.molecules`."""
from ._lazy import moved

__getattr__ = moved(__name__, "tgattn.datasets.molecules")
