import pytest
import torch

from analysis_cases import HAND
from tgattn.analysis import top_influencers


def test_direct_rollout_and_flow_rankings_on_the_hand_example():
    # Values worked out in test_analysis_rollout / test_analysis_flow.
    direct = top_influencers(2, 3, HAND[1])  # A2 row 2 = [0, .5, .5]: key 0 scores 0 and is left out
    assert direct.index.tolist() == [1, 2] and direct.score.tolist() == [0.5, 0.5]
    rollout = top_influencers(2, 3, HAND, method="rollout")
    assert rollout.index.tolist() == [2, 1, 0]
    torch.testing.assert_close(rollout.score, torch.tensor([0.46875, 0.28125, 0.25], dtype=torch.float64))
    flow = top_influencers(-1, 2, HAND, method="flow")
    assert flow.index.tolist() == [2, 0]
    torch.testing.assert_close(flow.score, torch.tensor([0.625, 0.5], dtype=torch.float64))
    assert top_influencers(2, 0, HAND, method="rollout").index.numel() == 0


def test_influencer_errors():
    with pytest.raises(ValueError, match="one layer"):
        top_influencers(0, 1, HAND)
    with pytest.raises(ValueError, match="method"):
        top_influencers(0, 1, HAND, method="gradient")
    with pytest.raises(ValueError, match="k must be >= 0"):
        top_influencers(0, -1, HAND, method="rollout")
    with pytest.raises(ValueError, match=r"i must be a token index in \[0, 3\)"):
        top_influencers(5, 1, HAND, method="rollout")
