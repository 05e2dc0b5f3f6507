"""No process group waits forever: a peer that is gone, stopped or at odds ends the job in bounded time.

Before, two processes that disagreed on WORLD_SIZE on one port waited silently (600 s), a
stopped rank held ``python -m tgattn.distributed.gpt`` for up to an hour (3600 s for the wall
limit and the gloo timeout), and a killed rank once left the job running past 200 s. Here each
case runs on loopback with a timeout of a few seconds; every process the tests start is ended
(spawn kills its ranks; subprocess.run kills on its own timeout).
"""
import os
import subprocess
import sys

import pytest

from conftest import REPO
from distributed_cases import rank_one_fails
from tgattn.distributed import spawn
from tgattn.distributed.launch import free_port

PEER_TIMEOUT_S = 3.0
WALL_S = 240.0  # far above what each case needs: reaching it means the bound did not hold
# Ranks that should meet wait this long to join: their imports may end seconds apart on a loaded
# machine, so only the case where a rank never joins waits out the short PEER_TIMEOUT_S.
JOIN_S = 120.0


@pytest.mark.slow
@pytest.mark.parametrize("how, message", [
    ("kill", "rank 1 was killed by SIGKILL"),
    ("stop", "rank 1 is stopped (SIGSTOP, for "),
    ("raise", "rank 1 failed: ValueError: rank one's own error"),
])
def test_spawn_ends_when_a_rank_is_gone_or_stuck(how, message):
    with pytest.raises(ChildProcessError) as ended:  # not the TimeoutError of the wall limit
        spawn(rank_one_fails, 2, how, timeout_s=WALL_S, peer_timeout_s=PEER_TIMEOUT_S)
    text = str(ended.value)
    assert text.startswith("rank_one_fails on 2 ranks ended: " + message) and "\n" not in text, text


def _ranks(code: str, world_sizes, timeout_s: float = WALL_S):
    """Runs ``code`` in one process per entry of ``world_sizes`` (RANK = its index) on one port: their outputs."""
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**env, "RANK": str(rank), "WORLD_SIZE": str(world)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, world in enumerate(world_sizes)]
    try:
        return [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


INIT = ("from tgattn.distributed import init\n"
        "try:\n    init('gloo', timeout_s=%g, join_timeout_s=%%g)\nexcept (ValueError, TimeoutError) as err:\n"
        "    print(err)\n" % PEER_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [(2, 3), (3, 2)], ids=["rank0_smaller", "rank0_larger"])
def test_ranks_that_disagree_on_world_size_both_fail_at_once(sizes):
    (out0, _), (out1, _) = _ranks(INIT % JOIN_S, sizes)
    assert out0.strip().startswith(f"rank 0 has WORLD_SIZE={sizes[0]} but rank 1 has WORLD_SIZE={sizes[1]} at 127.0.0.1:")
    assert out1.strip().startswith(f"rank 1 has WORLD_SIZE={sizes[1]} but rank 0 has WORLD_SIZE={sizes[0]} at 127.0.0.1:")


@pytest.mark.slow
def test_a_rank_that_never_joins_is_named_after_the_timeout():
    ((out, _),) = _ranks(INIT % PEER_TIMEOUT_S, [2])  # WORLD_SIZE=2, only rank 0 started; WALL_S bounds the wait
    assert out.strip().startswith(f"rank 0 of WORLD_SIZE=2: rank 1 did not join at 127.0.0.1:")
    assert f"within {PEER_TIMEOUT_S:g} s" in out


# init first with the long JOIN_S (launch's own init then finds the group made); the collective's
# timeout stays PEER_TIMEOUT_S.
LAUNCH = ("import distributed_cases\nfrom tgattn.distributed import init, launch\n"
          "init('gloo', timeout_s=%g, join_timeout_s=%g)\n"
          "try:\n    launch(distributed_cases.rank_one_fails, 2, 'kill', peer_timeout_s=%g)\n"
          "except TimeoutError as err:\n    print(err)\n" % (PEER_TIMEOUT_S, JOIN_S, PEER_TIMEOUT_S))


@pytest.mark.slow
def test_under_torchrun_a_rank_that_lost_its_peer_says_so_in_one_line():
    code = f"import sys\nsys.path.insert(0, {str(REPO / 'tests')!r})\n" + LAUNCH
    (out0, err0), _ = _ranks(code, [2, 2])
    assert out0.strip().startswith("rank 0 of 2 lost its peers (a rank is gone, or stuck past the 3 s timeout): "), err0
    assert out0.count("\n") == 1
