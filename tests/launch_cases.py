"""The rank side of tests/test_distributed_bounds.py: importable by a spawned rank (no conftest, no pytest)."""


def refuse_to_load():
    raise RuntimeError("this argument cannot be loaded in a rank")


class Unloadable:
    """An argument that a rank fails to load: rank 0 fails at once, while its peers would still be starting."""

    def __reduce__(self):
        return refuse_to_load, ()


def never_reached(rank, world, arg):
    raise AssertionError("the argument loaded")
