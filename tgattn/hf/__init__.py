"""Hugging Face transformers models on tgattn edge sets (``pip install "tgattn[hf]"``)::

    import tgattn.hf
    tgattn.hf.register()                        # attn_implementation "tgattn"
    model.set_attn_implementation("tgattn")     # any model using transformers' attention interface
    tgattn.hf.use_pattern(model, window=256)    # or any builder over the batch's lengths

* :func:`register` adds an attention function to transformers' ``AttentionInterface`` and a
  mask builder to its ``AttentionMaskInterface`` under one name. Both are needed: for a name
  without a mask builder transformers builds no mask at all (``None``), and padding would be
  silently ignored.
* The mask builder (:func:`tgattn.hf.masks.edge_mask`) turns the model's rule (causal,
  sliding window, chunked, packed sequences, bidirectional; padding) into one edge set per
  forward, in ``O(E)`` memory, shared by all layers; the attention function
  (:func:`tgattn.hf.attention.attention_forward`) runs each layer on it, with grouped-query
  attention reading key / value heads in place.
* :func:`use_pattern` swaps the model's self-attention pattern for any :mod:`tgattn.builders`
  builder; cross attention keeps the model's own mask.
* A dense score bias beside the mask (T5's relative ``position_bias``) and 4-D masks a model
  builds itself (float or boolean, per head, broadcast over queries) are read at the edges: the
  engine's per-edge ``bias``, exact, with gradients to the dense bias.
* Models tgattn cannot run exactly are refused, naming the model and the reason, never run
  wrong: attention off the interface (BLOOM, Falcon, MPNet, RoFormer, MPT,
  XGLM, ...) or a mask reworked by the model (Doge; any model that indexes or adds to the mask,
  which is an edge set, not a tensor) raise ``ValueError`` (:mod:`tgattn.hf.support`); an
  attention call with indexer-selected keys (DeepSeek V3.2's ``indices``) raises
  ``NotImplementedError``.
* Logit soft-capping (Gemma 2, VaultGemma, T5Gemma) and attention sinks (gpt-oss's ``s_aux``)
  go to :func:`tgattn.functional.graph_attention`'s ``softcap=`` / ``sinks=`` (on Triton's kernels or ``csr``).
* :func:`minilm_path`: the folder of a real pretrained model, all-MiniLM-L6-v2 (the
  ``tgattn[models]`` extra), extracted once into tgattn's cache (:mod:`tgattn.hf.pretrained`).
* :mod:`tgattn.hf.heads`: heads as graphs, the edges each head of a model attends to in one
  forward (top-k or a share of its weight), run again as one pattern (their union, through
  :func:`use_pattern`) or per head (:func:`tgattn.hf.heads.heads_only`).
* :func:`attention_graph` and :func:`show` read a model's attention as graphs for
  :mod:`tgattn.analysis` (rollout, flow, the pictures of ``python -m tgattn show``).

Sliding-window conventions: transformers' causal ``sliding_window = W`` keeps keys
``q - W < j <= q`` (W keys, the query included) = ``builders.window(n, W - 1, causal=True)``;
its bidirectional window keeps ``|q - j| <= W`` (2W + 1 keys) = ``builders.window(n, W)``.

Layer "applications" (with models, lm, hf, distributed, analysis, verify): built on the layers
below, never importing a benchmark or a command line (docs/conventions.md, "Layering").
"""
from .attention import attention_forward, recording
from .analysis import attention_graph, show
from .interface import register, use_pattern
from .masks import EdgeMask, edge_mask
from .pretrained import minilm_path

__all__ = ["EdgeMask", "attention_forward", "attention_graph", "edge_mask", "minilm_path", "recording", "register", "show",
           "use_pattern"]
