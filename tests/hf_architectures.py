"""The architectures of the installed transformers that tests/test_hf_matrix.py runs, and the table of docs/hf.md.

Each :class:`Arch` names a model class of transformers' auto mappings (causal LM, seq2seq,
masked LM), the overrides that make it tiny, and what tgattn does with it: ``exact`` (checked
against the dense float64 oracle, sdpa / eager and greedy ``generate``), refused (the error is
checked), or not tested (and why). ``python tests/hf_architectures.py`` writes the table into
docs/hf.md; ``test_docs_table_is_generated`` fails when the two differ.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

VOCAB = 96
DOCS = Path(__file__).resolve().parents[1] / "docs" / "hf.md"
BEGIN, END = "<!-- architectures: begin (python tests/hf_architectures.py) -->", "<!-- architectures: end -->"

# Small sizes, each set where the config has the field (names differ between families).
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, d_model=32, n_embd=32, num_attention_heads=4, n_head=4, num_heads=4,
    encoder_attention_heads=4, decoder_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, n_layer=2,
    num_layers=2, encoder_layers=2, decoder_layers=2, num_decoder_layers=2, intermediate_size=64, ffn_dim=64,
    encoder_ffn_dim=64, decoder_ffn_dim=64, d_ff=64, n_inner=64, head_dim=8, d_kv=8, max_position_embeddings=64,
    n_positions=64, num_experts=4, num_local_experts=4, n_routed_experts=4, moe_intermediate_size=32,
    num_experts_per_tok=2, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16,
    rotary_dim=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
)

# Why tgattn refuses a model: the start of the reason its error gives, and the table's words.
REFUSALS = {
    "off": ("its attention does not go through transformers' attention interface",
            "attention computed in the model's own code, off the attention interface"),
    "own_mask": ("it turns the mask into", "reworks the mask as a dense bias of its own"),
    "dense": ("it treats the attention mask as a dense tensor", "reworks the mask as a dense tensor"),
}


@dataclass(frozen=True)
class Arch:
    """One model class: how to build it tiny, and what tgattn does with it."""

    model_type: str  # key of transformers' CONFIG_MAPPING
    cls: str  # the model class, an attribute of transformers
    kind: str  # "decoder" (left padding), "encoder" (right padding) or "seq2seq" (padded encoder)
    config: Dict = field(default_factory=dict)  # overrides of TINY
    calls: int = 0  # attention calls in one forward (0: 2 layers, cross attention in each decoder layer)
    refused: Optional[str] = None  # a key of REFUSALS
    silent: bool = False  # built with attn_implementation="tgattn" it never calls tgattn: refused on selection only
    untested: Optional[str] = None  # why it is not run
    note: str = ""
    variant: str = ""  # a second configuration of the same class (its layer order, ...)
    padded_generate: Optional[str] = None  # the refusal of generate() from a padded batch, when it is refused

    @property
    def name(self) -> str:
        return f"{self.cls}[{self.variant}]" if self.variant else self.cls

    @property
    def attention_calls(self) -> int:
        return self.calls or (6 if self.kind == "seq2seq" else 2)

    @property
    def result(self) -> str:
        return "not tested" if self.untested else "refused" if self.refused else "exact"

    @property
    def why(self) -> str:
        return self.untested or (REFUSALS[self.refused][1] if self.refused else self.note)


def tiny_config(arch: Arch):
    """The config of ``arch`` with the sizes of :data:`TINY` (where it has the field) and its overrides."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[arch.model_type]
    defaults = config_class()
    sizes = {key: value for key, value in TINY.items() if hasattr(defaults, key)}
    return config_class(**{**sizes, "experts_implementation": "eager", **arch.config})


def tiny_model(arch: Arch, attn_implementation: str = "eager"):
    """``arch`` built tiny with seeded, spread-out weights (peaked attention: masks matter), in eval mode."""
    import torch
    import transformers

    cls = getattr(transformers, arch.cls)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls._from_config(tiny_config(arch), attn_implementation=attn_implementation).eval()
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() > 1:  # weights and embeddings; norms and biases keep their init
                    parameter.normal_(0.0, 0.3)
    return model


D, E, S = "decoder", "encoder", "seq2seq"
MAPPINGS = {D: "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", S: "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
            E: "MODEL_FOR_MASKED_LM_MAPPING_NAMES"}
# Logit soft-capping at 5 instead of the default 50, which the tiny models' scores never come near.
SOFTCAP = dict(attn_logit_softcapping=5.0)
SOFTCAP_NOTE = "attention logit soft-capping (attn_logit_softcapping=5)"


def _t5gemma_stack(**extra) -> Dict:
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=3,
                max_position_embeddings=64, **extra)  # layers: one sliding, one full


EXACT = {  # model types, one class each from MAPPINGS, that need nothing beyond TINY
    D: "afmoe apertus arcee aria_text bart beam bigbird_pegasus biogpt bitnet blenderbot blenderbot-small cohere "
       "cohere2 cohere2_moe ctrl cwm ernie4_5 ernie4_5_moe exaone4 exaone_moe flex_olmo gemma gemma3_text glm glm4 "
       "glm4_moe gpt2 gpt_bigcode gpt_neox granite granitemoe granitemoeshared helium hunyuan_v1_dense "
       "hunyuan_v1_moe hy_v3 hyperclovax inkling_text jais2 jetmoe kolibri1 laguna lfm2 llama llama4_text marian "
       "mbart mellum minimax_m2 minimax_m3_vl_text ministral ministral3 mistral mixtral modernbert-decoder moshi "
       "nanochat nemotron olmo olmo2 olmo3 olmoe opt pegasus persimmon phi phi3 phimoe plbart qwen2 qwen2_moe "
       "qwen3 qwen3_moe seed_oss smollm3 solar_open stablelm starcoder2 whisper",
    S: "bart blenderbot blenderbot-small m2m_100 marian mbart mt5 nllb-moe pegasus plbart seamless_m4t "
       "seamless_m4t_v2 switch_transformers t5 umt5",
    E: "albert bert camembert data2vec-text distilbert electra ernie esm eurobert gte jina_embeddings_v3 layoutlm "
       "modernbert nomic_bert roberta roberta-prelayernorm roc_bert ultrabert xlm-roberta xlm-roberta-xl",
}
BERT_DECODER = dict(config=dict(is_decoder=True))  # without it, a BERT-style LM head model is bidirectional
MLA = dict(config=dict(num_key_value_heads=4))  # multi-head latent attention: as many key / value heads as query heads
SPECIAL = [  # exact ones with their own sizes or call counts, and the refused ones
    (D, "bert", BERT_DECODER),
    (D, "bert-generation", BERT_DECODER),
    (D, "camembert", BERT_DECODER),
    (D, "data2vec-text", BERT_DECODER),
    (D, "electra", BERT_DECODER),
    (D, "ernie", BERT_DECODER),
    (D, "roberta", BERT_DECODER),
    (D, "roberta-prelayernorm", BERT_DECODER),
    (D, "roc_bert", BERT_DECODER),
    (D, "xlm-roberta", BERT_DECODER),
    (D, "xlm-roberta-xl", BERT_DECODER),
    (D, "deepseek_v2", MLA),
    (D, "glm4_moe_lite", MLA),
    (D, "minicpm3", MLA),
    (D, "sarvam_mla", {**MLA, "since": (5, 24)}),  # transformers' DeepSeek-V3 classes
    (D, "diffllama", dict(calls=4, note="two attention calls per layer (differential attention)")),
    (D, "hrm_text", dict(calls=16, note="layers run in recurrent cycles: 16 attention calls")),
    (D, "minimax", dict(calls=1, note="layers: one softmax, one linear attention")),
    (D, "minimax", dict(calls=1, variant="linear first", config=dict(layer_types=["linear_attention", "full_attention"]),
                        padded_generate="MiniMaxModel cannot generate from a padded batch on attn_implementation='tgattn'",
                        note="layers: one linear, one softmax attention (MiniMax-Text-01's order); generate() from a "
                             "padded batch refused: transformers sizes decoding masks by the first layer's empty cache, "
                             "which drops the padding (eager and sdpa ignore it)")),
    (D, "nemotron_h", dict(calls=1, note="layers 1-2: one Mamba, one attention")),
    (D, "olmo_hybrid", dict(calls=1, note="layers 1-2: one linear, one softmax attention")),
    (D, "qwen3_5_text", dict(calls=1, config=dict(layer_types=["linear_attention", "full_attention"]),
                             note="layers: one linear, one softmax attention")),
    (D, "qwen3_5_moe_text", dict(calls=1, config=dict(layer_types=["linear_attention", "full_attention"]),
                                 note="layers: one linear, one softmax attention")),
    (D, "qwen3_next", dict(calls=1, config=dict(layer_types=["linear_attention", "full_attention"]),
                           note="layers: one linear, one softmax attention")),
    (D, "lfm3", dict(calls=1, config=dict(layer_types=["conv", "full_attention"]),
                     note="layers: one convolution, one attention")),
    (D, "jamba", dict(calls=1, config=dict(attn_layer_offset=1, attn_layer_period=2),
                      note="layers: one Mamba, one attention")),
    (S, "t5gemma", dict(config=dict(encoder=_t5gemma_stack(**SOFTCAP), decoder=_t5gemma_stack(**SOFTCAP),
                                    vocab_size=VOCAB), note=SOFTCAP_NOTE)),
    (D, "gemma2", dict(config=SOFTCAP, note=SOFTCAP_NOTE)),
    (D, "vaultgemma", dict(config=SOFTCAP, note=SOFTCAP_NOTE)),
    (D, "gpt_oss", dict(note="attention sinks")),
    (D, "inkling2_loop_text", dict(untested="its MoE router computes in float32 on float32 weights: no float64 run "
                                            "(its sinks, one per query, are tested in tests/test_hf_sinks.py)",
                                   since=(5, 24))),
    (D, "dory", dict(untested="recurrent loops over copies of its cache: the tiny sizes need a config of its own",
                     since=(5, 24))),
    (S, "omniasr", dict(untested="needs pixel or audio inputs (multimodal)", since=(5, 24))),
    (D, "lara_mini", dict(calls=1, note="layers: one linear, one sliding-window attention", since=(5, 24))),
    (D, "flint", dict(note="attention sinks")),
    (D, "granite_swa", dict(note="attention sinks")),
    (D, "granitemoe_swa", dict(note="attention sinks")),
    (D, "mimo_v2_flash", dict(note="attention sinks")),
    (D, "deepseek_v4", dict(note="attention sinks")),
    (D, "deepseek_v32", dict(refused="dense")),
    (D, "glm_moe_dsa", dict(refused="dense")),
    (D, "hy_v4", dict(refused="dense")),
    (D, "axk2", dict(refused="dense")),
    (D, "git", dict(refused="dense")),
    (S, "bigbird_pegasus", dict(refused="dense", note="block-sparse encoder")),
    (D, "doge", dict(refused="own_mask")),
    (D, "bloom", dict(refused="off", note="ALiBi")),
    (D, "mpt", dict(refused="off", note="ALiBi")),
    (D, "codegen", dict(refused="off")),
    (D, "rembert", dict(refused="off")),
    (D, "megatron-bert", dict(refused="off")),
    (D, "trocr", dict(refused="off")),
    (D, "gpt_neox_japanese", dict(refused="off")),
    (D, "big_bird", dict(refused="off")),
    (D, "roformer", dict(refused="off")),
    (D, "openai-gpt", dict(refused="off", silent=True)),
    (D, "cpmant", dict(refused="off", silent=True)),
    (D, "xlm", dict(refused="off", silent=True)),
    (E, "mpnet", dict(refused="off")),
    (E, "deberta", dict(refused="off", silent=True)),
    (E, "deberta-v2", dict(refused="off", silent=True)),
    (S, "led", dict(refused="off")),
]
UNTESTED = {
    "needs pixel or audio inputs (multimodal)":
        "gemma3 gemma3n gemma4 gemma4_unified fuyu mllama got_ocr2 phi4_multimodal moss_transcribe_diarize "
        "audioflamingo3 glmasr granite_speech granite_speech_plus musicflamingo nemo_speechlm qwen2_audio qwen3_asr "
        "t5gemma2 vibevoice_asr voxtral voxtral_realtime modernvbert ultravbert emu3 dots3_note",
    "no attention layer (state space, recurrent, Fourier mixing)": "mamba falcon_mamba rwkv xlstm fnet",
    "part of its attention is computed by the model itself (encoder: local / global-local attention)":
        "longt5 pegasus_x",
}


# What changed with a release (the matrix holds for 5.23 and for the newest): the model types
# exact from it on (new in it, or moved onto the attention interface), and SPECIAL entries that
# held before it only (a SPECIAL entry new in a release says since=).
EXACT_FROM = {
    (5, 24): {D: "apertus1p5_text codegen gptj"},  # (exaone, sarvam_moe: Llama's and GLM-4-MoE's classes)
}
BEFORE = {  # (model type, the SPECIAL fields) -> the release from which on it no longer holds
    ("codegen", "refused"): (5, 24),  # 5.24 moved CodeGen and GPT-J onto the attention interface
}


def version() -> tuple:
    """The installed transformers' (major, minor)."""
    import transformers

    return tuple(int(part) for part in transformers.__version__.split(".")[:2])


def _arches():
    import transformers.models.auto.modeling_auto as auto

    classes = {kind: getattr(auto, name) for kind, name in MAPPINGS.items()}
    listed = [(kind, model_type, {}) for kind, names in EXACT.items() for model_type in names.split()]
    listed += [(kind, model_type, {}) for since, new in EXACT_FROM.items() if version() >= since
               for kind, names in new.items() for model_type in names.split()]
    listed += [(kind, model_type, {key: value for key, value in fields.items() if key != "since"})
               for kind, model_type, fields in SPECIAL if version() >= fields.get("since", (5, 0))
               and not any(version() >= until for (name, key), until in BEFORE.items() if name == model_type and key in fields)]
    for why, names in UNTESTED.items():
        for model_type in names.split():
            kind = next(kind for kind in MAPPINGS if model_type in classes[kind])
            listed.append((kind, model_type, dict(untested=why)))
    return [Arch(model_type, classes[kind][model_type], kind, **fields) for kind, model_type, fields in listed]


ARCHITECTURES = _arches()


def markdown_table() -> str:
    """The table of docs/hf.md: one row per architecture, with the counts first."""
    counts = {result: sum(a.result == result for a in ARCHITECTURES) for result in ("exact", "refused", "not tested")}
    lines = [f"{counts['exact']} exact, {counts['refused']} refused, {counts['not tested']} not tested "
             f"(transformers {__import__('transformers').__version__}):", "",
             "| model class | kind | result | why / note |", "|---|---|---|---|"]
    order = {"exact": 0, "refused": 1, "not tested": 2}
    for arch in sorted(ARCHITECTURES, key=lambda a: (order[a.result], a.name)):
        variant = f" ({arch.variant})" if arch.variant else ""
        lines.append(f"| `{arch.cls}`{variant} | {arch.kind} | {arch.result} | {arch.why} |")
    return "\n".join(lines)


def _table_span(text: str) -> re.Match:
    found = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    if found is None:
        raise ValueError(f"{DOCS} has no '{BEGIN}' ... '{END}' section")
    return found


def docs_table(text: str) -> str:
    """The generated part of docs/hf.md's ``text`` (between the markers)."""
    return _table_span(text).group(1)


def write_docs() -> None:
    text = DOCS.read_text()
    table = _table_span(text)
    DOCS.write_text(text[:table.start(1)] + markdown_table() + text[table.end(1):])


if __name__ == "__main__":
    sys.exit(write_docs())
