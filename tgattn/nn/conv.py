"""GraphAttentionConv: tgattn's attention as a PyG conv layer (a drop-in for TransformerConv/GATConv)."""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules import module as _nn_module
from torch.nn.parameter import is_lazy
from torch_geometric.nn import MessagePassing
from torch_geometric.nn.dense.linear import Linear
from torch_geometric.utils import add_self_loops as add_loops
from torch_geometric.utils import remove_self_loops

from .. import functional
from ..edgeset import EdgeSet, as_edge_set, checked_edges, edge_tensor, num_edges, prepare, self_looped
from . import _adjacency, _checkpoint
from .explain import explain_edge_scale

OptPairTensor = Tuple[Tensor, Optional[Tensor]]
_STEPS = ("propagate", "edge_update", "message", "aggregate")  # MessagePassing's hookable steps


class GraphAttentionConv(MessagePassing):
    r"""Multi-head scaled-dot-product attention over a graph's edges: PyG's ``TransformerConv``, every option.

    The transformer attention of Vaswani et al., "Attention Is All You Need" (2017), restricted to
    the in-neighbours of each node, as in the graph transformer of Shi et al., "Masked Label
    Prediction" (IJCAI 2021, PyG's ``TransformerConv``). For each head h, with
    :math:`q_i = W_Q^h x_i`, :math:`k_j = W_K^h x_j`, :math:`v_j = W_V^h x_j` and, with
    ``edge_dim``, :math:`e'_{ij} = W_E^h e_{ij}` (C channels each):

    .. math::
        \alpha^h_{ij} = \operatorname{softmax}_{j \in N(i)}
            \Big(\frac{\langle q_i, k_j + e'_{ij}\rangle}{\sqrt{C}} + w_h^\top e_{ij}\Big), \qquad
        o_i = \mathop{\Big\Vert}_{h} \sum_{j \in N(i)} \alpha^h_{ij} (v^h_j + e'^h_{ij})

    (mean over heads instead of concatenation with ``concat=False``; the score bias
    :math:`w_h^\top e_{ij}` only with ``edge_bias_dim``). The root term :math:`r_i = W_R x_i` is
    added, :math:`x'_i = o_i + r_i`, or with ``beta=True`` mixed in by a learned gate,
    :math:`x'_i = \beta_i r_i + (1 - \beta_i) o_i`,
    :math:`\beta_i = \sigma(w_\beta^\top [o_i \Vert r_i \Vert o_i - r_i])`. The constructor,
    the parameters (names and shapes) and the results are ``TransformerConv``'s, so a
    ``TransformerConv`` state_dict loads with ``strict=True``; the attention core is
    :func:`tgattn.functional.graph_attention` (edge features as its ``edge_key`` /
    ``edge_value``), so it equals dense masked attention.

    **Edge features**: ``edge_dim`` adds :math:`W_E e_{ij}` (``lin_edge``, ``[E, H * C]``) to
    the keys and the values, as ``TransformerConv`` does. With fewer edge features than channels
    the attention core applies :math:`W_E` to the features (``[E, H, edge_dim]``), never forming
    ``[E, H, C]``. ``edge_bias_dim`` instead turns edge features into a per-head *score bias*
    :math:`w_h^\top e_{ij}` (``lin_edge_bias = Linear(edge_bias_dim, heads, bias=False)``; what
    ``edge_dim`` meant here before, see ``docs/conv.md``). A ready-made score bias (``edge_bias=``
    in :meth:`forward`, ``[E]`` or ``[E, H]``) is added as it is, e.g. a learned
    shortest-path-distance bias of a graph transformer.

    **Self-loops** are left to the user unless ``add_self_loops=True``; then existing self-loops
    are removed and one per node is added (edge features of the new loops: the mean of the
    node's incoming edge features, as in ``GATConv``). Edge convention: ``edge_index[0]`` =
    source = key/value node j, ``edge_index[1]`` = target = query node i. A node without
    incoming edges gets attention output 0 (plus the root term).

    **PyG's roads.** The graph may come as ``edge_index``, a prepared :class:`~tgattn.EdgeSet`
    (:func:`tgattn.prepare`: checked and analysed once for every layer and step that uses it; its
    self-looped set and split of rows are made once and kept in it), ``EdgeIndex`` or a transposed sparse
    adjacency ``adj_t`` (``torch.sparse`` COO / CSR / CSC, ``torch_sparse.SparseTensor``;
    ``adj_t[i, j]`` = edge j -> i). ``(x_j, None)`` means no target features: the queries are
    those of all-zero features (:math:`q_i = b_Q`, so scores depend on the source only, as in
    ``GATConv`` without a target term) and there is no root term. ``in_channels=-1`` sizes the
    projections on the first call (``to_hetero`` works so). Under PyG's explainers the edge mask
    (``GNNExplainer``) scales the attention weights inside the attention core, with gradients to
    the mask; message hooks (``AttentionExplainer``) or a replaced ``explain_message`` switch to
    the message-passing path, whose ``message()`` sees ``alpha`` as ``GATConv``'s does.

    The arguments are ``TransformerConv``'s, in its order, then this class's own, keyword-only.

    Args:
        in_channels (int or tuple): size of each input sample, or ``(source, target)`` sizes for
            bipartite graphs; ``-1`` infers a size from the first input.
        out_channels (int): channels C per head.
        heads (int, optional): number of heads H (default: 1).
        concat (bool, optional): concatenate heads (output ``H * C``) or average them
            (output ``C``) (default: True).
        beta (bool, optional): mix the root term in by the learned gate :math:`\beta_i`
            (``lin_beta``); off without ``root_weight`` (default: False).
        dropout (float, optional): dropout on the attention weights in training mode (default: 0).
        edge_dim (int, optional): edge feature size; adds :math:`W_E e_{ij}` to keys and values
            (default: None).
        bias (bool, optional): biases in the query/key/value and root projections (default: True).
        root_weight (bool, optional): add the root/skip term :math:`W_R x_i` (default: True).
            Without it there is no ``lin_skip`` (``TransformerConv`` keeps an unused one; its
            weights are ignored on load).
        edge_bias_dim (int, optional): edge feature size of the per-head score bias; with
            ``edge_dim`` too, both read the same ``edge_attr`` (default: None).
        add_self_loops (bool, optional): replace self-loops by one per node (default: False).
        shared_projection (bool, optional): one projection for queries, keys and values,
            :math:`W_Q = W_K = W_V` (GAT's single ``W``; a third of the projection parameters;
            source and target sizes must agree; no ``lin_key`` / ``lin_value``) (default: False).

    Shapes:
        - input: ``x [N, F]`` or ``(x_j [Nk, F_s], x_i [Nq, F_t] or None)``, ``edge_index [2, E]``
          or ``adj_t [Nq, Nk]``, ``edge_attr [E, edge_dim]`` (optional)
        - output: ``[Nq, H * C]`` (concat) or ``[Nq, C]``; with ``return_attention_weights=True``
          also ``(edge_index [2, E'], alpha [E', H])`` for the edges used (self-loops included),
          for an ``adj_t`` the weights in its form (see ``GATConv``)

    Example:
        >>> conv = GraphAttentionConv(16, 8, heads=4)
        >>> x, edge_index = torch.randn(5, 16), torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]])
        >>> conv(x, edge_index).shape
        torch.Size([5, 32])
        >>> conv
        GraphAttentionConv(16, 8, heads=4)
        >>> from torch_geometric.nn import TransformerConv
        >>> pyg = TransformerConv(16, 8, 4, True, True, 0.0, 3)  # heads, concat, beta, dropout, edge_dim
        >>> ours = GraphAttentionConv(16, 8, 4, True, True, 0.0, 3)
        >>> _ = ours.load_state_dict(pyg.state_dict(), strict=True)
        >>> e = torch.randn(4, 3)
        >>> torch.allclose(ours(x, edge_index, e), pyg(x, edge_index, e), atol=1e-6)
        True
        >>> from torch_geometric.utils import to_torch_csr_tensor
        >>> adj_t = to_torch_csr_tensor(edge_index.flip(0), size=(5, 5))  # adj_t[i, j]: edge j -> i
        >>> torch.allclose(conv(x, adj_t), conv(x, edge_index))
        True
        >>> GraphAttentionConv(-1, 8, heads=4)(x, edge_index).shape  # lazy in_channels
        torch.Size([5, 32])
    """

    def __init__(
        self,
        in_channels: Union[int, Tuple[int, int]],
        out_channels: int,
        heads: int = 1,
        concat: bool = True,
        beta: bool = False,
        dropout: float = 0.0,
        edge_dim: Optional[int] = None,
        bias: bool = True,
        root_weight: bool = True,
        *,
        edge_bias_dim: Optional[int] = None,
        add_self_loops: bool = False,
        shared_projection: bool = False,
    ):
        super().__init__(aggr="add", node_dim=0)
        sizes = (in_channels, in_channels) if isinstance(in_channels, int) else tuple(in_channels)
        if len(sizes) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or (s <= 0 and s != -1) for s in sizes):
            raise ValueError(
                f"in_channels must be a positive int or -1, or a (source, target) pair of them (got {in_channels!r})"
            )
        for name, value in (("out_channels", out_channels), ("heads", heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int (got {value!r})")
        for name, value in (("edge_dim", edge_dim), ("edge_bias_dim", edge_bias_dim)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be None or a positive int (got {value!r})")
        if None not in (edge_dim, edge_bias_dim) and edge_dim != edge_bias_dim:
            raise ValueError(f"edge_dim and edge_bias_dim read the same edge_attr, so they must agree "
                             f"(got {edge_dim} and {edge_bias_dim})")
        if shared_projection and sizes[0] != sizes[1]:
            raise ValueError(f"shared_projection=True needs equal source and target sizes (got {in_channels!r})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1) (got {dropout})")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.heads = heads
        self.beta = bool(beta) and root_weight  # TransformerConv's rule: no gate without a root term
        self.root_weight = root_weight
        self.concat = concat
        self.dropout = dropout
        self.edge_dim = edge_dim
        self.edge_bias_dim = edge_bias_dim
        self.add_self_loops = add_self_loops
        self.shared_projection = shared_projection
        width = heads * out_channels
        out_width = width if concat else out_channels
        # TransformerConv's modules, built in its order (the same seed gives the same weights), with
        # PyG's Linear: nn.Linear's initialisation and lazy sizes (-1).
        self.lin_key = None if shared_projection else Linear(sizes[0], width, bias=bias)
        self.lin_query = Linear(sizes[1], width, bias=bias)
        self.lin_value = None if shared_projection else Linear(sizes[0], width, bias=bias)
        self.lin_edge = Linear(edge_dim, width, bias=False) if edge_dim is not None else None
        # TransformerConv keeps an unused lin_skip without root_weight; here it is dropped on load
        # (an unused parameter stops DistributedDataParallel and costs memory: 1433 x 64 on Cora).
        self.lin_skip = Linear(sizes[1], out_width, bias=bias) if root_weight else None
        self.lin_beta = Linear(3 * out_width, 1, bias=False) if self.beta else None
        self.lin_edge_bias = Linear(edge_bias_dim, heads, bias=False) if edge_bias_dim is not None else None
        self.reset_parameters()

    def reset_parameters(self):
        super().reset_parameters()
        for lin in (self.lin_key, self.lin_query, self.lin_value, self.lin_edge, self.lin_skip, self.lin_beta,
                    self.lin_edge_bias):
            if lin is not None:
                lin.reset_parameters()

    def _load_from_state_dict(self, state_dict, prefix, *args):
        _checkpoint.adapt(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args)
        args[-1].extend(_checkpoint.option_mismatches(self, state_dict, prefix))  # error_msgs

    def forward(
        self,
        x: Union[Tensor, OptPairTensor],
        edge_index,
        edge_attr: Optional[Tensor] = None,
        return_attention_weights: bool = False,
        *,
        size: Optional[Tuple[Optional[int], Optional[int]]] = None,
        edge_bias: Optional[Tensor] = None,
        backend: str = "auto",
    ):
        """Attend along ``edge_index`` (row 0 = key/source j, row 1 = query/target i).

        Args:
            x: node features ``[N, F]``, or ``(x_j, x_i)`` for a bipartite graph (``x_i`` may be None).
            edge_index: ``[2, E]``, an :class:`~tgattn.EdgeSet`, an ``EdgeIndex``, or a sparse
                ``adj_t [Nq, Nk]`` (see the class).
            edge_attr: edge features ``[E, edge_dim]`` (or ``[E]`` when it is 1), in the edge
                order of ``edge_index``; for a sparse ``adj_t`` its values serve when omitted.
            return_attention_weights: also return the weights (see Shapes).
            size: ``(Nk, Nq)``, the node counts (default: from ``x`` or the adjacency).
            edge_bias: a score bias ``[E]`` (all heads) or ``[E, H]`` added as it is (e.g. a learned
                structural bias computed outside the layer); not with ``add_self_loops=True``.
            backend: ``"message_passing"`` runs PyG's ``propagate`` (the readable ``message()``
                path); anything else goes to :func:`tgattn.functional.graph_attention`.
        """
        x_j, x_i = (x, x) if isinstance(x, Tensor) else x
        adj = edge_index
        reads_edges = self.edge_dim is not None or self.edge_bias_dim is not None
        edge_index, edge_attr, size = _adjacency.read(adj, edge_attr, size, values=reads_edges)
        size = _node_counts(size, x_j, x_i)  # (Nk, Nq)
        H, C = self.heads, self.out_channels
        if (edge_attr is None) == reads_edges:
            raise ValueError(
                "edge_attr must be given exactly when edge_dim or edge_bias_dim is set "
                f"(edge_dim={self.edge_dim}, edge_bias_dim={self.edge_bias_dim}; edge_attr "
                f"{'missing' if edge_attr is None else 'given'})"
            )
        if edge_attr is not None and edge_attr.device != x_j.device:
            raise ValueError(f"edge_attr is on the {edge_attr.device} device, but x is on {x_j.device}")
        if edge_bias is not None and self.add_self_loops:
            raise ValueError("edge_bias needs add_self_loops=False (it must match the edges passed in)")
        if self.add_self_loops:
            edge_index, edge_attr = self._with_self_loops(edge_index, edge_attr, *size)
        edge_attr = self._check_edge_attr(edge_attr, num_edges(edge_index))  # [E, F] or None
        bias = self._score_bias(edge_attr, edge_bias)  # [E, H], [E] or None
        p = self.dropout if self.training else 0.0
        messages = backend == "message_passing" or self._wants_messages()
        # A row with one edge outputs that edge's value, a row without edges 0, whatever its query,
        # when nothing else acts on the weights: then only the rows with two edges or more need
        # a query and the attention (see _attended_rows).
        plain = not (messages or return_attention_weights or self._explain or p > 0 or bias is not None
                     or self.lin_edge is not None)
        rows = _attended_rows(edge_index, *size) if plain else None
        if rows is not None and not self._finite_scores(x_j, x_i):
            rows = None  # a NaN or infinite score gives its one-edge row NaN, not the edge's value
        q, k, v, root = self._project(x_j, x_i, size[1], None if rows is None else rows.queries)
        # q [Nq or R, H, C], k [Nk, H, C], v [Nk, H, C], root term [Nq, H*C or C] or None
        if messages:
            edge_vectors = None if self.lin_edge is None else self.lin_edge(edge_attr).view(-1, H, C)  # [E, H, C]
            out, alpha = self._propagate(q, k, v, edge_index, bias, edge_vectors, p, size)
        elif rows is not None:
            out, alpha = rows.attend(q, k, v, backend), None  # [Nq, H, C]
        else:
            # An explainer's edge mask scales the weights (added self-loops: factor 1, as in PyG).
            loops = size[1] if self.add_self_loops else 0
            mask = explain_edge_scale(self, num_edges(edge_index), loops) if self._explain else None  # [E]
            # The edge term as (features, weight): the core applies W_E itself, without [E, H, C] when it can.
            term = None if self.lin_edge is None else (edge_attr, self.lin_edge.weight)
            # Weights only when asked: they keep the engine off dense SDPA.
            out = functional.graph_attention(
                q, k, v, edge_index, bias=bias, dropout_p=p, return_weights=return_attention_weights, backend=backend,
                edge_scale=mask, edge_key=term, edge_value=term,
            )  # [Nq, H, C] (and alpha [E, H])
            out, alpha = out if return_attention_weights else (out, None)
        out = self._with_root(out.reshape(-1, H * C) if self.concat or H == 1 else out.mean(dim=1), root)
        if return_attention_weights:
            return out, _adjacency.write(adj, edge_tensor(edge_index), alpha, size)
        return out

    def _with_root(self, out: Tensor, root: Optional[Tensor]) -> Tensor:
        """The heads' output ``[Nq, H*C or C]`` plus the root term, or mixed with it by the ``beta`` gate."""
        if root is None:
            return out
        if self.lin_beta is None:
            return out + root
        if _hooked(self.lin_beta):
            gate = self.lin_beta(torch.cat([out, root, out - root], dim=-1)).sigmoid()  # [Nq, 1]
            return torch.lerp(out, root, gate)  # gate * root + (1 - gate) * out
        return functional.beta_mix(out, root, self.lin_beta.weight)

    def _project(self, x_j: Tensor, x_i: Optional[Tensor], num_queries: int, query_rows: Optional[Tensor] = None):
        """``(q [Nq or R, H, C], k [Nk, H, C], v [Nk, H, C], root term [Nq, H*C or C] or None)``.

        The projections of one input run as one matrix product where it is sparse (:func:`_linears`):
        with ``x_i is x_j``, queries, keys, values and the root term all come from one product.
        ``query_rows [R]``: queries for these target rows only, from their own product.
        """
        H, C = self.heads, self.out_channels
        if x_i is None:  # no target features: the queries of all-zero features, no root term
            if self.lin_query.in_channels < 0:
                raise ValueError("x = (x_j, None) needs the target size: give in_channels, or pass x_i once")
            x_i, skip_lin = x_j.new_zeros(num_queries, self.lin_query.in_channels), None
        else:
            skip_lin = self.lin_skip
        same = x_i is x_j
        on_j = [self.lin_query] if self.shared_projection else [self.lin_key, self.lin_value]
        shared_q = self.shared_projection and same  # the queries are the keys
        queries = [] if shared_q or query_rows is not None else [self.lin_query]
        on_i = queries + ([skip_lin] if skip_lin else [])
        outs = _linears(x_j, on_j + on_i) if same else _linears(x_j, on_j) + _linears(x_i, on_i)
        outs_j, outs_i = outs[: len(on_j)], outs[len(on_j):]
        k = outs_j[0].view(-1, H, C)  # [Nk, H, C]
        v = k if self.shared_projection else outs_j[1].view(-1, H, C)  # [Nk, H, C]
        if shared_q:
            q = k if query_rows is None else k[query_rows]  # [Nq or R, H, C]
        elif query_rows is not None:
            q = self.lin_query(x_i[query_rows]).view(-1, H, C)  # [R, H, C]
        else:
            q = outs_i.pop(0).view(-1, H, C)  # [Nq, H, C]
        return q, k, v, outs_i[0] if skip_lin is not None else None

    def _finite_scores(self, x_j: Tensor, x_i: Optional[Tensor]) -> bool:
        """Whether every score is finite (up to an overflow of finite numbers): the features and the
        query and key projections' parameters are, which the one-edge rows' shortcut needs to equal
        the softmax (a single NaN or infinite score has weight NaN there, as in ``TransformerConv``)."""
        lins = [self.lin_query] + ([] if self.lin_key is None else [self.lin_key])
        params = [t for lin in lins for t in (lin.weight, lin.bias) if t is not None and not is_lazy(t)]
        features = [x_j] + ([] if x_i is None or x_i is x_j else [x_i])
        return functional.all_finite(*features, *params)

    def _check_edge_attr(self, edge_attr: Optional[Tensor], num_edges: int) -> Optional[Tensor]:
        """``edge_attr`` as ``[E, F]``, checked against the width the conv was built for."""
        if edge_attr is None:
            return None
        edge_attr = edge_attr.view(-1, 1) if edge_attr.dim() == 1 else edge_attr
        width = self.edge_dim if self.edge_dim is not None else self.edge_bias_dim
        name = "edge_dim" if self.edge_dim is not None else "edge_bias_dim"
        if edge_attr.shape != (num_edges, width):
            raise ValueError(
                f"edge_attr must have shape [E, {name}] = [{num_edges}, {width}] (got {list(edge_attr.shape)})"
            )
        return edge_attr

    def _score_bias(self, edge_attr: Optional[Tensor], edge_bias: Optional[Tensor]) -> Optional[Tensor]:
        bias = self.lin_edge_bias(edge_attr) if self.lin_edge_bias is not None else None  # [E, H]
        if bias is not None:  # +inf from infinite features: NaN, the softmax of +inf (a given +inf bias is refused)
            bias = torch.where(bias == float("inf"), float("nan"), bias)
        if edge_bias is not None:
            bias = edge_bias if bias is None else bias + (edge_bias.view(-1, 1) if edge_bias.dim() == 1 else edge_bias)
        return bias

    def _with_self_loops(self, edge_index, edge_attr, num_keys, num_queries):
        if num_keys != num_queries:
            raise ValueError(
                f"add_self_loops=True needs as many source as target nodes (got {num_keys} and {num_queries})"
            )
        if edge_attr is None and not torch.compiler.is_compiling():  # made once per edge set, prepared
            return self_looped(edge_index, num_queries), None
        return _self_loops(edge_tensor(edge_index), edge_attr, num_queries)

    # The message-passing path: PyG's edge_updater + propagate, readable, and what hooks see.

    def _wants_messages(self) -> bool:
        """Whether something must see the message-passing steps: a hook on them (message hooks:
        ``AttentionExplainer``) or a replaced ``explain_message`` (``GraphMaskExplainer``)."""
        if any(getattr(self, f"_{step}_forward{kind}_hooks") for step in _STEPS for kind in ("_pre", "")):
            return True
        if not self._explain:
            return False
        return getattr(self.explain_message, "__func__", None) is not MessagePassing.explain_message

    def _propagate(self, q, k, v, edge_index, bias, edge_vectors, p, size):
        edge_index = checked_edges(edge_index, size[1], size[0])
        alpha = self.edge_updater(
            edge_index, q=(None, q), k=(k, None), bias=bias, edge_vectors=edge_vectors, size=size
        )  # [E, H]
        used = F.dropout(alpha, p) if p > 0 else alpha
        # PyG's generic propagate: the compiled one PyG gives a subclass of an already built conv
        # class ignores explain (edge masks would never apply).
        out = MessagePassing.propagate(
            self, edge_index, v=(v, None), alpha=used, edge_vectors=edge_vectors, size=size
        )  # [Nq, H, C]
        return out, alpha

    def edge_update(self, q_i: Tensor, k_j: Tensor, bias: Optional[Tensor], edge_vectors: Optional[Tensor],
                    index: Tensor, size_i: int) -> Tensor:
        key = k_j if edge_vectors is None else k_j + edge_vectors  # [E, H, C]: k_j + W_E e_ij
        score = (q_i * key).sum(dim=-1) * self.out_channels**-0.5  # [E, H]
        if bias is not None:
            score = score + bias.view(score.shape[0], -1)
        return functional.edge_softmax(score, index, size_i)

    def message(self, v_j: Tensor, alpha: Tensor, edge_vectors: Optional[Tensor]) -> Tensor:
        value = v_j if edge_vectors is None else v_j + edge_vectors  # [E, H, C]: v_j + W_E e_ij
        return alpha.unsqueeze(-1) * value  # a_ij (v_j + W_E e_ij), summed at i by aggr="add"

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.in_channels}, {self.out_channels}, heads={self.heads})"


def _self_loops(edge_index: Tensor, edge_attr: Optional[Tensor], num_nodes: int):
    """The edges without their self-loops, then one loop per node (features: the mean of the
    node's incoming edge features, as in ``GATConv``): a new edge set each call, for edge features
    (which change with the set) and under ``torch.compile``; otherwise :func:`tgattn.edgeset.self_looped`."""
    edge_index = functional.check_edge_index(edge_index, num_nodes, num_nodes)
    edge_index, edge_attr = remove_self_loops(edge_index, edge_attr)
    return add_loops(edge_index, edge_attr, fill_value="mean", num_nodes=num_nodes)


# The rows split off only where E < this many edges per target row: the split saves the work of
# the rows with at most one edge (at most Nq rows' worth) and costs O(E) passes, so on graphs
# with more edges than that per row (a full-batch graph) it cannot pay, and is not even looked for.
_SPLIT_EDGES_PER_ROW = 4


class _AttendedRows(NamedTuple):
    """The target rows of an edge set by their edge count: ``queries [R]`` with two edges or more,
    attended over ``edges`` (an :class:`~tgattn.EdgeSet` of their edges, targets numbered 0 .. R - 1
    in the order of ``queries``); every other row outputs ``v[source]`` of its one edge, or 0 without
    edges: ``source [Nq]`` (any key for the attended rows), ``empty [Z]`` the rows without edges."""

    queries: Tensor
    edges: EdgeSet
    source: Tensor
    empty: Tensor

    def attend(self, q: Tensor, k: Tensor, v: Tensor, backend: str) -> Tensor:
        """``out [Nq, H, C]`` from the attended rows' queries ``q [R, H, C]`` and all keys and values."""
        out = v.index_select(0, self.source)  # [Nq, H, C]: a one-edge row's weight is exactly 1
        if len(self.queries):
            attended = functional.graph_attention(q, k, v, self.edges, backend=backend)  # [R, H, C]
            out = out.index_copy(0, self.queries, attended)
        return out.index_fill(0, self.empty, 0.0) if len(self.empty) else out


def _attended_rows(edges, num_keys: int, num_queries: int) -> Optional[_AttendedRows]:
    """The split of the target rows of ``edges`` (a tensor or an :class:`~tgattn.EdgeSet`;
    :class:`_AttendedRows`), where at least half of them have at most one edge; else None. Made once
    per edge set and kept in it (a tensor's: in the set the cache prepares for it).

    A row with one edge has softmax weight exactly 1 on it, so it outputs the edge's value and its
    query gets no gradient; a row without edges outputs 0. In a NeighborLoader batch most rows are
    such (the last hop's nodes: only their self-loop, or nothing): there the queries of the other
    rows alone are projected and only those rows reach the attention kernel, whose per-row work is
    the rest of the saving. On the host only (a GPU would wait for the counts it reads).
    """
    if torch.compiler.is_compiling() or not 0 < num_edges(edges) < _SPLIT_EDGES_PER_ROW * num_queries:
        return None
    if not functional.on_host(edges.structure.src if isinstance(edges, EdgeSet) else edges):
        # On a GPU the split reads its counts back (syncs) once per edge set and the shortcut's finite
        # check every call (see forward), where the kernels spend little on rows of one edge.
        return None
    es = as_edge_set(edges, num_queries, num_keys)  # a tensor: validated here, on its first call
    return es.derived("conv_rows", lambda: _split_rows(es))


def _split_rows(es: EdgeSet) -> Optional[_AttendedRows]:
    """:class:`_AttendedRows` of a prepared edge set, or None where more than half of its rows have
    two edges or more. O(E + Nq), from its sorted edges and row pointer."""
    s = es.structure
    src, dst = s.src.long(), s.dst.long()
    deg = s.rowptr.diff()  # [Nq] edges per row
    many = deg >= 2
    if 2 * int(many.sum()) > es.num_queries:
        return None
    queries = many.nonzero().flatten()  # [R]
    rank = torch.cumsum(many, 0) - 1  # [Nq] position of an attended row among them
    keep = many[dst]  # [E] the edges of the attended rows
    source = torch.zeros(es.num_queries, dtype=torch.long, device=dst.device)
    source[dst[~keep]] = src[~keep]  # a one-edge row's one edge
    attended = prepare(torch.stack([src[keep], rank[dst[keep]]]), len(queries), es.num_keys)
    return _AttendedRows(queries, attended, source, (deg == 0).nonzero().flatten())


# The widest projection (outputs) that stacks with its siblings when x's gradient is wanted (_linears).
STACK_WIDTH = 32


def _linears(x: Tensor, lins: List[Linear]) -> List[Tensor]:
    """``[lin(x) for lin in lins]``, as one matrix product over the stacked weights where that is cheaper:
    where ``x`` is sparse, or where its gradient is wanted and the projections are narrow.

    One product instead of several reads ``x`` once and pays one call: on sparse features
    (Planetoid's bag of words) the Cora training step of the GAT network got 12 % faster. Its
    backward first concatenates its outputs' gradients (a copy of ``[N, sum of outputs]``), which
    dense features pay for unless the product also gives ``x``'s gradient from narrow projections:
    ``[N, sum of outputs] @ W`` is then one product where three products of ``[N, o] @ [o, F]`` (at
    most ``STACK_WIDTH`` outputs, too few for the library's blocking) run far below its speed, plus
    two sums. Forward and backward of three projections of 64 features with x's gradient, one
    thread, separate -> stacked: 16 outputs each 0.87x at N = 3,040 (the molecule step's second
    layer; that step 0.97x), 0.66-0.76x at N = 12,160 to 93,524; 8 outputs 0.69x, 32 outputs
    0.86-0.94x; 47 outputs 0.96-1.07x, 64 outputs 1.05x. Without x's gradient: 64 -> 3 x 64 1.26x,
    3 x 16 1.10x (on the dense features of a NeighborLoader batch, 93,524 x 100 to three projections
    of 64, 166 against 138 ms). So dense inputs without a gradient or with wider projections run
    one by one (:func:`_affine`), and projections not sized yet (``in_channels=-1``) or with hooks
    through their modules.
    """
    if any(_hooked(lin) or lin.in_channels < 0 for lin in lins):
        return [lin(x) for lin in lins]
    wanted = x.requires_grad and torch.is_grad_enabled() and all(lin.out_channels <= STACK_WIDTH for lin in lins)
    if len(lins) < 2 or (x.layout == torch.strided and not wanted):
        return [_affine(x, lin.weight, lin.bias) for lin in lins]
    weight = torch.cat([lin.weight for lin in lins])  # [sum of outputs, F]
    bias = None if lins[0].bias is None else torch.cat([lin.bias for lin in lins])
    return list(_affine(x, weight, bias).split([lin.out_channels for lin in lins], dim=-1))


def _affine(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``F.linear(x, weight, bias)``; on the host, for dense ``x``, a product with the bias added in place.

    On the CPU ``addmm`` (``F.linear`` with a bias) first copies the bias into every row of its output
    and multiplies onto that: in the molecule step the four copies took 0.2-0.3 ms, and the step with
    product-then-sum projections ran 0.97-0.985x (one process, interleaved, three runs). Only the
    roundings differ (the bias joins the sum last). On a GPU ``addmm`` adds the bias in the product's
    own kernel: one launch, not two.
    """
    if bias is None or x.layout != torch.strided or not functional.on_host(x):
        return F.linear(x, weight, bias)
    return torch.matmul(x, weight.t()).add_(bias)


def _hooked(lin: Linear) -> bool:
    """Whether a forward hook (global or on ``lin``) must see ``lin`` called as a module."""
    hooked = _nn_module._global_forward_pre_hooks or _nn_module._global_forward_hooks
    return bool(hooked or lin._forward_pre_hooks or lin._forward_hooks)


def _node_counts(size, x_j: Tensor, x_i: Optional[Tensor]) -> Tuple[int, int]:
    """``(Nk, Nq)`` from ``size`` (entries may be None) and the features, which must agree."""
    counts = []
    for name, given, x in (("source", size[0], x_j), ("target", size[1], x_i)):
        if x is not None and given is not None and x.shape[0] != given:
            raise ValueError(f"size gives {given} {name} nodes, but x has {x.shape[0]} {name} rows")
        counts.append(x.shape[0] if x is not None else given)
    return counts[0], counts[1] if counts[1] is not None else counts[0]
