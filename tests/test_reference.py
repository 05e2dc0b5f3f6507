"""The oracle itself, checked against PyTorch's own attention implementations."""
import pytest
import torch
import torch.nn.functional as F

from tgattn.reference import dense_attention


def _qkv(nq, nk, h, dk, dv, dtype=torch.float64):
    return torch.randn(nq, h, dk, dtype=dtype), torch.randn(nk, h, dk, dtype=dtype), torch.randn(nk, h, dv, dtype=dtype)


@pytest.mark.parametrize("heads", [1, 2, 8])
def test_equals_sdpa_with_bool_mask(heads):
    q, k, v = _qkv(9, 11, heads, 4, 4)
    mask = torch.rand(9, 11) < 0.5
    mask[:, 0] = True  # SDPA returns NaN for empty rows; the oracle's own rule is tested below
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    torch.testing.assert_close(dense_attention(q, k, v, mask), ref.transpose(0, 1), rtol=0, atol=1e-12)


def test_equals_sdpa_with_float_bias_and_scale():
    q, k, v = _qkv(6, 6, 2, 4, 4)
    bias = torch.randn(2, 6, 6, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=bias, scale=0.3)
    out = dense_attention(q, k, v, None, bias=bias, scale=0.3)
    torch.testing.assert_close(out, ref.transpose(0, 1), rtol=0, atol=1e-12)


def test_dv_differs_from_dk_matches_explicit_softmax():
    q, k, v = _qkv(5, 7, 3, 4, 6)
    mask = torch.rand(5, 7) < 0.6
    mask[:, 3] = True
    scores = torch.einsum("ihd,jhd->hij", q, k) / 2.0  # scale 1/sqrt(4)
    expected = torch.einsum("hij,jhd->ihd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(dense_attention(q, k, v, mask), expected, rtol=0, atol=1e-12)


def test_empty_rows_give_zero_output_and_zero_gradient():
    q, k, v = (t.requires_grad_() for t in _qkv(4, 4, 2, 3, 3))
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[1] = False
    bias = torch.zeros(4, 4, dtype=torch.float64)
    bias[2] = float("-inf")  # a row whose every key is removed by the bias
    out = dense_attention(q, k, v, mask, bias=bias)
    assert torch.equal(out[1], torch.zeros(2, 3, dtype=torch.float64))
    assert torch.equal(out[2], torch.zeros(2, 3, dtype=torch.float64))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1])) and torch.equal(q.grad[2], torch.zeros_like(q.grad[2]))


def test_per_head_mask_equals_each_head_alone():
    q, k, v = _qkv(5, 5, 2, 4, 4)
    masks = torch.rand(2, 5, 5) < 0.5
    masks[:, :, 0] = True
    out = dense_attention(q, k, v, masks)
    for h in range(2):
        single = dense_attention(q[:, h : h + 1], k[:, h : h + 1], v[:, h : h + 1], masks[h])
        torch.testing.assert_close(out[:, h : h + 1], single, rtol=0, atol=1e-14)


def test_weights_rows_sum_to_one():
    q, k, v = _qkv(5, 5, 2, 4, 4)
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    _, weights = dense_attention(q, k, v, mask, return_weights=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 5, dtype=torch.float64))
    assert (weights[:, ~mask] == 0).all()


def test_no_keys_gives_zeros():
    q, k, v = (t.requires_grad_() for t in _qkv(3, 0, 2, 4, 5))
    out = dense_attention(q, k, v, torch.zeros(3, 0, dtype=torch.bool))
    assert torch.equal(out, torch.zeros(3, 2, 5, dtype=torch.float64))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))
