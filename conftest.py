"""Doctests of the optional integrations are collected only when their package is installed."""
import importlib.util

collect_ignore = []
if importlib.util.find_spec("transformers") is None:
    collect_ignore += ["tgattn/hf", "tgattn/bench/hf.py"]
