"""Deprecated path of :mod:`tgattn.builders.informer` (probsparse_attention, lazy_values)."""
from ._lazy import moved

__getattr__ = moved(__name__, "tgattn.builders.informer")
