"""Bad option and argument values are one line naming the argument and the value (issue 57.9).

Before: ``show --max-page-mb inf`` ended in an OverflowError traceback, ``python -m tgattn.bench
--device nonsense`` in torch's RuntimeError traceback, ``tgattn.prepare(edges, 10**30, 12)`` in
torch's overflow error naming neither ``num_queries`` nor the value, and ``EdgeSet.tile_plan``
raised ZeroDivisionError (``group=0``), accepted ``group=-1``, named an internal ``block_m=21``
(``group=3``) and raised AttributeError (``dtype="bf16"``).
"""
import pytest
import torch

import tgattn
from conftest import one_line_error
from tgattn import builders
from tgattn.__main__ import main as tgattn_main
from tgattn.bench.__main__ import main as bench_main


def test_show_refuses_an_infinite_page_budget(cli, tmp_path):
    status, err = cli(tgattn_main, ["show", "--max-page-mb", "inf", "--html", str(tmp_path / "p.html")])
    assert status == 2 and one_line_error(err, "python -m tgattn show") == "argument --max-page-mb: must be finite (got 'inf')"


@pytest.mark.parametrize("device", ["nonsense", "cuda:x", "gpu", "cpu:0:1"])
def test_bench_refuses_an_unknown_device_in_one_line(cli, device):
    status, err = cli(bench_main, ["--device", device])
    assert status == 2 and one_line_error(err, "python -m tgattn.bench") == (
        f"argument --device: must be cpu, cuda or cuda:N (got {device!r})")


@pytest.mark.parametrize("sizes, name, value", [
    ((10**30, 12), "num_queries", 10**30),
    ((12, 2**63), "num_keys", 2**63),
    ((-1, 12), "num_queries", -1),
])
def test_prepare_names_a_node_count_out_of_range(sizes, name, value):
    with pytest.raises(ValueError) as refused:
        tgattn.prepare(torch.tensor([[0, 1], [1, 0]]), *sizes)
    assert str(refused.value) == f"{name} must be a node count, an int in [0, 2**63) (got {value})"


@pytest.fixture(scope="module")
def window_set():
    return tgattn.prepare(builders.window(128, 8), 128, 128)


GATHERED = "backend='tc' runs other groups wholly on its gather kernels"


@pytest.mark.parametrize("kwargs, message", [
    (dict(group=0), f"group must be a power of two >= 1, the query heads a key head serves (got 0): {GATHERED}"),
    (dict(group=-1), f"group must be a power of two >= 1, the query heads a key head serves (got -1): {GATHERED}"),
    (dict(group=3), f"group must be a power of two >= 1, the query heads a key head serves (got 3): {GATHERED}"),
    (dict(group=2.0), f"group must be a power of two >= 1, the query heads a key head serves (got 2.0): {GATHERED}"),
    (dict(dtype="bf16"), "dtype must be torch.float16 or torch.bfloat16, the tiles' dtypes (got 'bf16')"),
    (dict(dtype=torch.int64), "dtype must be torch.float16 or torch.bfloat16, the tiles' dtypes (got torch.int64)"),
    (dict(head_dim=0), "head_dim must be an integer from 1 to 128 (got 0)"),
    (dict(head_dim=256), "head_dim must be an integer from 1 to 128 (got 256)"),
])
def test_tile_plan_names_a_bad_argument(window_set, kwargs, message):
    with pytest.raises(ValueError) as refused:
        window_set.tile_plan(**kwargs)
    assert str(refused.value) == message


def test_tile_plan_takes_every_power_of_two_group(window_set):
    """A group of G query heads a key head: tiles of 64 / G query rows x G heads (the block's 64 rows)."""
    for group in (1, 2, 4, 8):
        plan = window_set.tile_plan(torch.float16, 64, group=group)
        assert (plan.block_m, plan.block_n) == (64 // group, 64)


@pytest.mark.parametrize("module, argv, message", [
    ("graph_transformers.command", ["--limit-mb", "inf"], "argument --limit-mb: must be finite (got 'inf')"),
    ("graph_transformers.command", ["--budget-s", "nan"], "argument --budget-s: must be a number > 0 (got 'nan')"),
    ("hf", ["--mask-gb", "inf"], "argument --mask-gb: must be finite (got 'inf')"),
    ("hf", ["--mask-gb=-1"], "argument --mask-gb: must be a number >= 0 (got '-1')"),
])
def test_the_benchmarks_float_options_are_finite(cli, module, argv, message):
    """Before: plain ``float`` took inf and nan (and a negative mask budget)."""
    import importlib

    bench = importlib.import_module(f"tgattn.bench.{module}")  # a benchmark with parts: its command module
    status, err = cli(bench.main, argv)
    prog = f"python -m tgattn.bench.{module.removesuffix('.command')}"
    assert status == 2 and one_line_error(err, prog) == message
