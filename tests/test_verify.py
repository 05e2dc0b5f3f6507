"""The main job, `python -m tgattn verify`."""
import torch

from conftest import one_line_error
from tgattn import verify
from tgattn.__main__ import main


def test_every_case_passes():
    results = [verify.check(case) for case in verify.CASES]
    assert all(r.passed for r in results), verify.format_table(results)
    assert all(r.edges > 0 for r in results)


def test_a_wrong_result_fails():
    # The check must be able to fail: drop one edge inside graph_attention only.
    def corrupt():
        ei = verify.builders.causal(8)
        return ei, 8, 8

    case = verify.Case("corrupt", corrupt)
    original = verify.graph_attention
    try:
        verify.graph_attention = lambda q, k, v, ei, **kw: original(q, k, v, ei[:, 1:], **kw)
        assert not verify.check(case).passed
    finally:
        verify.graph_attention = original


def test_command_line_prints_table_and_exit_code(capsys):
    status = main(["verify"])  # `python -m tgattn verify` in this process (CI runs the real command line)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "causal(64)" in out and "FAIL" not in out
    assert f"{len(verify.CASES)} passed, 0 failed" in out


def test_an_unknown_backend_is_a_one_line_error(cli):
    status, err = cli(main, ["verify", "--backend", "nope"])
    assert status == 2 and one_line_error(err, "python -m tgattn verify").startswith(
        "argument --backend: invalid choice: 'nope' (choose from 'auto', 'gather', 'dense', 'tile', 'fused', 'csr'")
