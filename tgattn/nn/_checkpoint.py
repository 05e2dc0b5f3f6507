"""GraphAttentionConv's checkpoints: TransformerConv's state_dicts and this class's older ones.

A ``TransformerConv`` state_dict loads with ``strict=True``; :func:`adapt` drops what this conv
does not keep and renames what an older version named otherwise, :func:`option_mismatches`
names the option behind a weight of another shape.
"""
from __future__ import annotations

from typing import List

from torch_geometric.nn.dense.linear import is_uninitialized_parameter


def adapt(conv, state_dict, prefix: str) -> None:
    """Edit ``state_dict`` in place for ``conv`` (a ``GraphAttentionConv``) before it loads."""
    if conv.lin_skip is None:  # TransformerConv keeps its root weights with root_weight=False, unused
        for key in ("lin_skip.weight", "lin_skip.bias"):
            state_dict.pop(prefix + key, None)
    old_bias = prefix + "lin_edge.weight"
    if conv.lin_edge is None and conv.lin_edge_bias is not None and prefix + "lin_edge_bias.weight" not in state_dict:
        if old_bias in state_dict and state_dict[old_bias].shape == conv.lin_edge_bias.weight.shape:
            # A checkpoint of the score-bias variant from when edge_dim meant it (see docs/conv.md).
            state_dict[prefix + "lin_edge_bias.weight"] = state_dict.pop(old_bias)


def option_mismatches(conv, state_dict, prefix: str) -> List[str]:
    """The option behind each weight of ``state_dict`` whose shape differs from ``conv``'s (a
    mismatch PyTorch reports by shape only); keys present on one side only PyTorch names itself."""
    explain = {
        "lin_skip": f"concat={conv.concat} (or in_channels, heads * out_channels)",
        "lin_beta": f"concat={conv.concat} (or heads * out_channels)",
        "lin_edge": f"edge_dim={conv.edge_dim} (or heads * out_channels)",
        "lin_edge_bias": f"edge_bias_dim={conv.edge_bias_dim} (or heads)",
    }
    messages = []
    for name in ("lin_key", "lin_query", "lin_value", "lin_edge", "lin_skip", "lin_beta", "lin_edge_bias"):
        module, theirs = getattr(conv, name), state_dict.get(f"{prefix}{name}.weight")
        if module is None or theirs is None or is_uninitialized_parameter(module.weight):
            continue
        if theirs.shape == module.weight.shape:
            continue
        shape, ours = list(theirs.shape), list(module.weight.shape)
        if name == "lin_edge" and shape[0] == conv.heads:
            why = (f"it is the per-head score bias that edge_dim meant in GraphAttentionConv before it took "
                   f"TransformerConv's meaning: build the conv with edge_bias_dim={shape[1]} instead of edge_dim")
        else:
            why = f"the state_dict comes from a conv with other options than {explain.get(name, 'in_channels, heads * out_channels')}"
        messages.append(f"{prefix}{name}.weight has shape {shape}, this {conv} expects {ours}: {why}")
    return messages
