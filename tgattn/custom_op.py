"""Deprecated path of :mod:`tgattn.engine.custom_op` (importing it still registers the ops)."""
from ._lazy import moved

__getattr__ = moved(__name__, "tgattn.engine.custom_op")
