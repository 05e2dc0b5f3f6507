"""What a sparse attention pattern costs a trained model: the sparsity-fidelity study.

:func:`fidelity` runs a model on passages of a text with its own attention (the reference) and
under each chosen pattern (:mod:`tgattn.analysis.fidelity_patterns`), and reports per pattern:

* ``edges_kept``: the edges each head attends along, as a share of the reference's (mean over
  layers and heads);
* output fidelity: for an encoder the cosine of the mean-pooled embedding (``pooled_cosine``) and
  of each token's last hidden state (``token_cosine``, mean and worst token); for a causal LM the
  perplexity of the passage's next tokens (``perplexity``, ``perplexity_full``) and the KL
  divergence of each next-token distribution from the reference's (``kl``, nats, mean over tokens);
* ``mass_kept``: the share of the reference softmax each head's kept edges hold (mean over
  queries; ``mass_kept`` the mean over heads, ``mass_kept_min`` the worst head; per layer and head
  in :attr:`Study.mass`);
* ``seconds``: the pattern's forward (wall clock, mean over passages).

Each number is the mean over passages (``token_cosine_min``: the minimum). A pattern keeping
every edge scores exactly the reference: cosines are computed as ``1 - |a/|a| - b/|b||^2 / 2``,
exactly 1 for equal outputs, and the mass kept as 1 minus the mass dropped.

The model: the real all-MiniLM-L6-v2 by default (:func:`tgattn.hf.minilm_path`), any transformers
folder or hub id (``hf=``), or a tiny GPT checkpoint of :mod:`tgattn.lm` (``checkpoint=``).
"""
from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import torch
from torch import Tensor

from ..hf.heads import select_heads
from .fidelity_models import GPTSubject, HFSubject, NotApplicable, Run
from .fidelity_patterns import DEFAULT_PATTERNS, SPECS, Pattern, builder_of, parse_pattern


@dataclass
class Study:
    """The result of :func:`fidelity`: a row per pattern (the reference first), mass per layer and head."""

    model: str
    causal: bool
    length: int
    passages: int
    rows: List[Dict[str, object]]
    mass: Dict[str, List[List[float]]]  # pattern -> [L][H] attention mass kept (mean over passages)
    skipped: Dict[str, str] = field(default_factory=dict)  # pattern -> why it does not apply


def cosine(a: Tensor, b: Tensor) -> Tensor:
    """Cosine of the rows of ``a`` and ``b`` in float64, exactly 1 where they are equal.

    Example:
        >>> x = torch.randn(3, 5)
        >>> bool((cosine(x, x) == 1).all()), round(float(cosine(x[:1], -x[:1])), 6)
        (True, -1.0)
    """
    a, b = a.double(), b.double()
    unit_a, unit_b = a / a.norm(dim=-1, keepdim=True), b / b.norm(dim=-1, keepdim=True)
    return 1 - (unit_a - unit_b).pow(2).sum(-1) / 2


def mass_kept(reference: Sequence, kept: Sequence, length: int) -> Tensor:
    """``[L, H]``: the share of each head's reference attention that the kept edges hold, mean over queries.

    ``reference``: per layer ``(edge_index, alpha [E, H])``; ``kept``: per layer ``(edge_index, keep [E', H])``.
    """
    masses = []
    for (ref_ei, alpha), (ei, keep) in zip(reference, kept):
        heads = alpha.shape[1]
        weight = torch.zeros(heads, length * length, dtype=torch.float64)
        weight[:, ref_ei[1] * length + ref_ei[0]] = alpha.double().t()  # [H, T*T], rows = queries
        held = torch.zeros(heads, length * length, dtype=torch.bool)
        held[:, ei[1] * length + ei[0]] = keep.t()
        masses.append(1 - weight.masked_fill(held, 0).sum(1) / length)
    return torch.stack(masses)


def _scores(subject, ids: Tensor, run: Run, reference: Run):
    edges = reference.kept[0][0].shape[1]
    share = float(torch.stack([keep.sum(0) for _, keep in run.kept]).double().mean()) / edges
    mass = mass_kept(reference.attention, run.kept, ids.shape[0])
    row = {"edges_kept": share, "mass_kept": float(mass.mean()), "mass_kept_min": float(mass.min()),
           "seconds": run.seconds}
    if subject.causal:
        log_p, log_full = torch.log_softmax(run.output.double(), -1), torch.log_softmax(reference.output.double(), -1)
        nxt = ids[1:].view(-1, 1)
        row["perplexity"] = float(torch.exp(-log_p[:-1].gather(1, nxt).mean()))
        row["perplexity_full"] = float(torch.exp(-log_full[:-1].gather(1, nxt).mean()))
        row["kl"] = float((log_full.exp() * (log_full - log_p)).sum(-1).mean())
    else:
        tokens = cosine(run.output, reference.output)
        row["pooled_cosine"] = float(cosine(run.output.mean(0, keepdim=True), reference.output.mean(0, keepdim=True)))
        row["token_cosine"], row["token_cosine_min"] = float(tokens.mean()), float(tokens.min())
    return row, mass


def _run(subject, ids: Tensor, pattern: Pattern, reference: Run) -> Run:
    if pattern.name == "full":
        return subject.run(ids)
    if pattern.name == "topk":
        return subject.run(ids, topk=pattern.args[0])
    if pattern.name == "indexer":
        return subject.run(ids, own=True)
    if pattern.name == "heads":
        return subject.run(ids, heads=select_heads(reference.attention, ids.shape[0], mass=pattern.args[0]))
    return subject.run(ids, builder=builder_of(pattern, subject.causal))


def load_subject(hf: Optional[str] = None, checkpoint: Optional[str] = None):
    """The model of the study: a tiny GPT ``checkpoint``, a transformers folder / hub id ``hf``, else
    all-MiniLM-L6-v2."""
    if hf is not None and checkpoint is not None:
        raise ValueError(f"give hf or checkpoint, not both (got hf={hf!r}, checkpoint={checkpoint!r})")
    if checkpoint is not None:
        return GPTSubject.load(checkpoint)
    if hf is None:
        from ..hf.pretrained import NAME, minilm_path

        return HFSubject.load(str(minilm_path()), name=NAME)
    return HFSubject.load(hf)


def fidelity(subject=None, *, text: Optional[str] = None, length: Optional[int] = None, passages: int = 1,
             patterns: Sequence = DEFAULT_PATTERNS, progress: bool = True) -> Study:
    """Run the study: each pattern against the model's own attention on ``passages`` passages of ``length`` tokens.

    Args:
        subject: what :func:`load_subject` returns (default: all-MiniLM-L6-v2, from ``tgattn[models]``).
        text: the text (default: Tiny Shakespeare, :func:`tgattn.datasets.load_tiny_shakespeare`).
        length: tokens per passage, special tokens included (default: 512, or the model's longest if
            shorter); characters for a GPT checkpoint (default: its ``block_size``).
        passages: consecutive passages of the text to average over.
        patterns: pattern names such as ``"window:32"`` (:data:`~tgattn.analysis.fidelity_patterns.SPECS`)
            or parsed :class:`~tgattn.analysis.fidelity_patterns.Pattern` s; ``full`` (the reference) is always run.
        progress: show a tqdm bar (one step per passage and pattern).

    Returns:
        :class:`Study`; a pattern the model cannot run is left out, with the reason, in ``skipped``.
    """
    from tqdm.auto import tqdm

    subject = load_subject() if subject is None else subject
    if text is None:
        from ..datasets import load_tiny_shakespeare

        text = load_tiny_shakespeare()
    parsed = [p if isinstance(p, Pattern) else parse_pattern(p) for p in patterns]
    parsed = list({p.label: p for p in [parse_pattern("full")] + [p for p in parsed if p.name != "full"]}.values())
    length = subject.default_length if length is None else length
    inputs = subject.passages(text, length, passages)
    sums: Dict[str, Dict[str, float]] = {}
    masses: Dict[str, Tensor] = {}
    skipped: Dict[str, str] = {}
    subject.run(inputs[0])  # warm-up, untimed: the first forward pays for one-time setup
    bar = tqdm(total=len(inputs) * len(parsed), desc="fidelity", unit="run", disable=not progress)
    for ids in inputs:
        reference = subject.run(ids)
        for pattern in parsed:
            bar.update(1)
            if pattern.label in skipped:
                continue
            try:
                run = reference if pattern.name == "full" else _run(subject, ids, pattern, reference)
            except NotApplicable as why:
                skipped[pattern.label] = str(why)
                continue
            row, mass = _scores(subject, ids, run, reference)
            total = sums.setdefault(pattern.label, {})
            for key, value in row.items():
                total[key] = min(total.get(key, value), value) if key.endswith("_min") else total.get(key, 0) + value
            masses[pattern.label] = masses.get(pattern.label, 0) + mass
    bar.close()
    count = len(inputs)
    rows = [{"pattern": label, **{k: (v if k.endswith("_min") else v / count) for k, v in total.items()}}
            for label, total in sums.items()]
    return Study(subject.name, subject.causal, length, count, rows,
                 {label: (m / count).tolist() for label, m in masses.items()}, skipped)


def table(study: Study) -> str:
    """The rows as a Markdown table (what the docs include).

    Example:
        >>> row = {"pattern": "full", "edges_kept": 1.0, "mass_kept": 1.0, "mass_kept_min": 1.0, "seconds": 0.2,
        ...        "pooled_cosine": 1.0, "token_cosine": 1.0, "token_cosine_min": 1.0}
        >>> print(table(Study("m", False, 8, 1, [row], {})).splitlines()[2])
        | full | 100.0% | 1.0000 | 1.0000 / 1.0000 | 100.0% / 100.0% | 0.20 |
    """
    fidelity = ["perplexity", "kl"] if study.causal else ["pooled_cosine", "token_cosine"]
    head = ["pattern", "edges kept", *(["perplexity", "KL (nats)"] if study.causal else
                                       ["pooled cosine", "token cosine (mean / min)"]),
            "mass kept (mean / worst head)", "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in study.rows:
        scores = [f"{row[key]:.4f}" for key in fidelity]
        if not study.causal:
            scores[1] += f" / {row['token_cosine_min']:.4f}"
        cells = [row["pattern"], f"{row['edges_kept']:.1%}", *scores,
                 f"{row['mass_kept']:.1%} / {row['mass_kept_min']:.1%}", f"{row['seconds']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def save_study(study: Study, out: Union[str, Path], *, command: str = "") -> List[Path]:
    """Write ``fidelity.csv`` (a row per pattern), ``fidelity.md`` (:func:`table`), ``fidelity.json``
    (everything, with ``command``) and ``fidelity.png`` (the fidelity-density frontier; needs
    matplotlib) into the folder ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(key for row in study.rows for key in row))
    with open(out / "fidelity.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(study.rows)
    (out / "fidelity.md").write_text(table(study))
    described = {row["pattern"]: SPECS[parse_pattern(row["pattern"]).name][1] for row in study.rows}
    (out / "fidelity.json").write_text(json.dumps({**asdict(study), "patterns": described, "command": command},
                                                  indent=1) + "\n")
    figure = frontier_figure(study)
    figure.savefig(out / "fidelity.png", dpi=120, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(figure)
    return [out / name for name in ("fidelity.csv", "fidelity.md", "fidelity.json", "fidelity.png")]


def frontier_figure(study: Study):
    """Fidelity against the share of edges kept, one point per pattern, the frontier (best fidelity at
    most that density) as a line: pooled-embedding cosine for an encoder, KL from the reference for a causal LM."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    key, label = ("kl", "KL(full || pattern), nats per token (lower is better)") if study.causal else \
        ("pooled_cosine", "cosine of the mean-pooled embedding to full attention")
    rows = sorted(study.rows, key=lambda row: row["edges_kept"])
    x, y = [row["edges_kept"] for row in rows], [row[key] for row in rows]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.scatter(x, y, color="tab:blue", zorder=3, label=key)
    if not study.causal:
        axes.scatter(x, [row["token_cosine"] for row in rows], facecolors="none", edgecolors="tab:orange",
                     zorder=3, label="token_cosine (mean over tokens)")
    best, frontier = None, []
    for xi, yi in zip(x, y):  # the best fidelity reached at this density or below
        if best is None or (yi < best if study.causal else yi > best):
            best = yi
            frontier.append((xi, yi))
    axes.step(*zip(*frontier), where="post", color="tab:blue", alpha=0.4, label="frontier")
    for place, (row, xi, yi) in enumerate(zip(rows, x, y)):  # labels above and below in turn: equal densities
        axes.annotate(row["pattern"], (xi, yi), textcoords="offset points", xytext=(4, 5 - 14 * (place % 2)),
                      fontsize=8)
    axes.xaxis.set_major_formatter(PercentFormatter(1.0))
    axes.set_xlabel("edges kept per head (share of full attention)")
    axes.set_ylabel(label)
    axes.set_title(f"{Path(study.model).name}: {study.passages} passage(s) of {study.length} tokens", fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="lower right" if not study.causal else "upper right")
    return figure
