"""GPSConv: the GraphGPS layer with its global attention on tgattn (exact, no padding)."""
from __future__ import annotations

import copy
from typing import Any, Dict, Optional, Union

import numpy
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import GPSConv as PyGGPSConv
from torch_geometric.nn import MessagePassing
from torch_geometric.nn.inits import reset

from .. import builders
from ..edgeset import EdgeSet, all_pairs_per_graph
from .attention import GraphAttention


def full_per_graph(batch: Optional[Tensor], num_nodes: int) -> Tensor:
    """All node pairs of each graph of a PyG batch: ``builders.full(lengths)``, ``[2, sum L**2]``.

    ``batch`` is PyG's graph-assignment vector ``[N]`` (nodes of a graph are contiguous, graphs
    in order, as ``Batch.from_data_list`` makes them); ``None`` means one graph of ``num_nodes``.

    Example:
        >>> full_per_graph(torch.tensor([0, 0, 1]), 3)
        tensor([[0, 1, 0, 1, 2],
                [0, 0, 1, 1, 2]])
    """
    if batch is None:
        return builders.full(num_nodes)
    if batch.numel() != num_nodes:
        raise ValueError(f"batch has {batch.numel()} entries, but x has {num_nodes} nodes")
    if batch.numel() > 1 and bool((batch[1:] < batch[:-1]).any()):
        raise ValueError("batch must be sorted (the nodes of each graph contiguous, as in a PyG Batch)")
    lengths = torch.bincount(batch) if batch.numel() else batch.new_zeros(0)  # [B]
    return builders.full(lengths, device=batch.device)


def _all_pairs(batch: Optional[Tensor], x: Tensor) -> EdgeSet:
    """:func:`full_per_graph` prepared, made from the graphs' sizes with one read of ``batch`` (a GPU's
    sync) and no analysis (:func:`tgattn.edgeset.all_pairs_per_graph`)."""
    if batch is None:
        return all_pairs_per_graph(torch.zeros(x.size(0), dtype=torch.long, device=x.device), [x.size(0)])
    if batch.numel() != x.size(0):
        raise ValueError(f"batch has {batch.numel()} entries, but x has {x.size(0)} nodes")
    ids = batch.cpu().numpy()  # the one read: the order check and the graphs' sizes on the host
    if (ids[1:] < ids[:-1]).any():
        raise ValueError("batch must be sorted (the nodes of each graph contiguous, as in a PyG Batch)")
    return all_pairs_per_graph(batch, numpy.bincount(ids).tolist() if ids.size else [])


class GPSConv(PyGGPSConv):
    r"""The GPS layer of Rampasek et al., with exact global attention over tgattn edge sets.

    "Recipe for a General, Powerful, Scalable Graph Transformer", NeurIPS 2022
    (https://arxiv.org/abs/2205.12454). A drop-in for :class:`torch_geometric.nn.GPSConv`
    (same constructor, same sub-modules ``conv``, ``attn``, ``mlp``, ``norm1..3``, same
    update rule, and an instance of it), whose global branch is a
    :class:`~tgattn.GraphAttention` instead of ``to_dense_batch`` + ``nn.MultiheadAttention``:

    .. math::
        h_L = \mathrm{norm}_1(x + \mathrm{MPNN}(x)), \quad
        h_G = \mathrm{norm}_2(x + \mathrm{Attn}(x, A)), \quad
        x' = \mathrm{norm}_3(h + \mathrm{MLP}(h)),\ h = h_L + h_G

    where ``A`` is ``attn_edge_index``: by default every node pair of each graph of the
    batch (:func:`full_per_graph`), which equals PyG's padded multi-head attention with its
    key-padding mask but does no work on padding. Any other edge set (an Exphormer set,
    :func:`tgattn.builders.exphormer`) and an additive score bias ``attn_bias`` (e.g. a
    shortest-path-distance bias, :class:`~tgattn.nn.SpatialEncoding`) may be given.

    Do not assign a ``GraphAttention`` to the ``attn`` of PyG's own ``GPSConv``: its forward
    calls only ``nn.MultiheadAttention`` / ``PerformerAttention`` and silently returns the
    input for anything else (the global branch becomes ``2 x``). :func:`check_gps` detects
    that; :meth:`from_pyg` converts a PyG layer with its weights, and ``load_state_dict``
    takes a state dict saved from a model built on PyG's ``GPSConv`` (strict: its attention's
    packed ``in_proj_weight`` / ``in_proj_bias`` are split into ``q_proj``, ``k_proj``, ``v_proj``).

    Args:
        channels (int): size of each node feature D.
        conv (MessagePassing, optional): the local message-passing layer (``None``: none).
        heads (int, optional): attention heads H (default: 1).
        dropout (float, optional): dropout after each branch and in the MLP (default: 0).
        act (str or Callable, optional): MLP activation (default: ``"relu"``).
        act_kwargs (dict, optional): arguments of the activation (default: None).
        norm (str or Callable, optional): normalization (default: ``"batch_norm"``).
        norm_kwargs (dict, optional): arguments of the normalization (default: None).
        attn_type (str, optional): only ``"multihead"`` (exact softmax attention; PyG's
            ``"performer"`` approximates it) (default: ``"multihead"``).
        attn_kwargs (dict, optional): ``dropout`` and ``bias`` of the attention (default: None).
        backend (str, optional): the attention backend (:func:`tgattn.functional.graph_attention`).
            ``"auto"`` runs the default all-pairs set of a batch on SDPA, one call per distinct
            graph size; for batches of many small graphs of many sizes (molecules) ``"fused"``
            is faster: forward+backward of the attention on 128 graphs of 5..47 nodes, D = 64,
            H = 4, 2 threads, a loaded machine: 54 ms fused, 304 ms auto, 136 ms PyG's padded MHA
            (default: ``"auto"``).

    Shapes:
        - input: ``x [N, D]``, ``edge_index [2, E_local]``, ``batch [N]`` (optional),
          ``attn_edge_index [2, E]`` (optional), ``attn_bias [E]`` or ``[E, H]`` (optional)
        - output: ``[N, D]``

    Example:
        >>> from torch_geometric.nn import GINConv
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> layer = GPSConv(8, GINConv(torch.nn.Linear(8, 8)), heads=2)
        >>> x, batch = torch.randn(5, 8), torch.tensor([0, 0, 0, 1, 1])
        >>> layer(x, torch.tensor([[0, 1, 3], [1, 2, 4]]), batch).shape
        torch.Size([5, 8])
    """

    def __init__(
        self,
        channels: int,
        conv: Optional[MessagePassing],
        heads: int = 1,
        dropout: float = 0.0,
        act: str = "relu",
        act_kwargs: Optional[Dict[str, Any]] = None,
        norm: Optional[str] = "batch_norm",
        norm_kwargs: Optional[Dict[str, Any]] = None,
        attn_type: str = "multihead",
        attn_kwargs: Optional[Dict[str, Any]] = None,
        *,
        backend: str = "auto",
    ):
        if attn_type != "multihead":
            raise ValueError(f"attn_type must be 'multihead' (exact attention on tgattn) (got {attn_type!r})")
        attn_kwargs = dict(attn_kwargs or {})
        unknown = set(attn_kwargs) - {"dropout", "bias"}
        if unknown:
            raise ValueError(f"attn_kwargs takes 'dropout' and 'bias' (got {sorted(unknown)})")
        super().__init__(channels, conv, heads, dropout, act, act_kwargs, norm, norm_kwargs, "multihead", attn_kwargs)
        self.attn = GraphAttention(channels, heads, **attn_kwargs)
        self.backend = backend

    def reset_parameters(self):
        if self.conv is not None:
            self.conv.reset_parameters()
        self.attn.reset_parameters()
        reset(self.mlp)
        for norm in (self.norm1, self.norm2, self.norm3):
            if norm is not None:
                norm.reset_parameters()

    def _norm(self, norm: Optional[nn.Module], h: Tensor, batch: Optional[Tensor]) -> Tensor:
        if norm is None:
            return h
        return norm(h, batch=batch) if self.norm_with_batch else norm(h)

    def forward(
        self,
        x: Tensor,
        edge_index: Tensor,
        batch: Optional[Tensor] = None,
        *,
        attn_edge_index: Optional[Union[Tensor, EdgeSet]] = None,
        attn_bias: Optional[Tensor] = None,
        **kwargs,
    ) -> Tensor:
        """One GPS layer; ``kwargs`` go to the local ``conv`` (e.g. ``edge_attr``).

        Build ``attn_edge_index`` once per batch and pass it to every layer, best prepared
        (:func:`tgattn.prepare`, an :class:`~tgattn.EdgeSet`): then no layer checks or looks up its
        edges (a plain tensor is analysed once and found again in a cache, checked by contents).
        """
        hs = []
        if self.conv is not None:  # local MPNN
            h = F.dropout(self.conv(x, edge_index, **kwargs), p=self.dropout, training=self.training)
            hs.append(self._norm(self.norm1, h + x, batch))
        if attn_edge_index is None:
            attn_edge_index = _all_pairs(batch, x)
        h = self.attn(x, attn_edge_index, attn_bias, backend=self.backend)  # [N, D] global attention, no padding
        h = F.dropout(h, p=self.dropout, training=self.training)
        hs.append(self._norm(self.norm2, h + x, batch))
        out = sum(hs)
        return self._norm(self.norm3, out + self.mlp(out), batch)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A state dict of PyG's GPSConv holds its nn.MultiheadAttention's packed in-projection,
        # attn.in_proj_weight [3D, D] and attn.in_proj_bias [3D] (rows: W_Q, W_K, W_V); the
        # GraphAttention keeps the three apart. Split here, before the attention's own keys are
        # matched, so that such a checkpoint loads strictly; every other key is PyG's own.
        for kind in ("weight", "bias"):
            packed = state_dict.pop(f"{prefix}attn.in_proj_{kind}", None)
            if packed is not None:
                for name, part in zip(("q_proj", "k_proj", "v_proj"), packed.chunk(3)):
                    state_dict[f"{prefix}attn.{name}.{kind}"] = part
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @classmethod
    def from_pyg(cls, layer: PyGGPSConv, *, backend: str = "auto") -> "GPSConv":
        """A tgattn ``GPSConv`` with the sub-modules and weights of PyG's ``layer`` (copied).

        ``layer`` must use ``nn.MultiheadAttention`` (``attn_type="multihead"``).
        """
        if not isinstance(layer.attn, nn.MultiheadAttention):
            raise TypeError(f"layer.attn must be an nn.MultiheadAttention (got {type(layer.attn).__name__})")
        new = cls(layer.channels, None, layer.heads, layer.dropout, norm=None, backend=backend)
        new.conv = copy.deepcopy(layer.conv)
        new.mlp = copy.deepcopy(layer.mlp)
        new.norm1, new.norm2, new.norm3 = (copy.deepcopy(n) for n in (layer.norm1, layer.norm2, layer.norm3))
        new.norm_with_batch = layer.norm_with_batch
        new.attn = GraphAttention.from_multihead(layer.attn)
        return new.train(layer.training)


def check_gps(model: nn.Module) -> nn.Module:
    """Raise if a PyG ``GPSConv`` in ``model`` would silently skip its global attention.

    PyG's ``GPSConv.forward`` runs its ``attn`` only when it is an ``nn.MultiheadAttention`` or
    a ``PerformerAttention``; any other module assigned to ``attn`` (a ``GraphAttention``
    included) is never called, and the global branch adds the input to itself. Returns
    ``model`` unchanged when every layer is fine.

    Raises:
        TypeError: naming the layer and the ignored module, with the fix.

    Example:
        >>> from tgattn import GraphAttention
        >>> layer = PyGGPSConv(8, None, heads=2)
        >>> layer.attn = GraphAttention(8, 2)
        >>> check_gps(torch.nn.Sequential(layer))
        Traceback (most recent call last):
        ...
        TypeError: 0 is a torch_geometric GPSConv whose attn is a GraphAttention, which its forward never calls (it silently skips global attention); use tgattn.nn.GPSConv (tgattn.nn.GPSConv.from_pyg(layer) keeps the weights)
    """
    from torch_geometric.nn.attention import PerformerAttention

    for name, module in model.named_modules():
        if isinstance(module, PyGGPSConv) and not isinstance(module, GPSConv):
            if not isinstance(module.attn, (nn.MultiheadAttention, PerformerAttention)):
                raise TypeError(
                    f"{name or 'model'} is a torch_geometric GPSConv whose attn is a {type(module.attn).__name__}, "
                    "which its forward never calls (it silently skips global attention); use tgattn.nn.GPSConv "
                    "(tgattn.nn.GPSConv.from_pyg(layer) keeps the weights)"
                )
    return model
