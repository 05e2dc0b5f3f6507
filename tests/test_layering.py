"""The package's layering, read from the source (ast; nothing of tgattn is imported here).

engine < functional < builders < nn (with data, datasets) < models / lm / hf / distributed /
analysis / verify < bench and the command lines (docs/conventions.md, "Layering"). Every
``import`` counts, also one inside a function: an import deferred to call time still makes a
cycle, and still reaches upward. The checks name both files of each offending import.
"""
import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "tgattn"

# Lowest first. A module belongs to the layer of its longest listed prefix; anything in a layer
# may import from its own layer (when that makes no cycle) and from the layers below.
LAYERS = [
    ("helpers", ["tgattn._cli"]),  # imports nothing of tgattn; every room uses it
    ("engine", ["tgattn.engine"]),
    ("functional", ["tgattn.functional", "tgattn.edgeset"]),  # edgeset: the prepared set's public face
    ("builders", ["tgattn.builders"]),
    ("nn", ["tgattn.nn", "tgattn.data", "tgattn.datasets"]),
    ("applications", ["tgattn.models", "tgattn.lm", "tgattn.hf", "tgattn.distributed", "tgattn.analysis",
                      "tgattn.verify", "tgattn.reference"]),  # reference: the dense oracle that verify runs
    ("bench / commands", ["tgattn", "tgattn.bench"]),  # the package root names every room (lazily)
]
# Command lines inside a lower room, in the top layer (as is every __main__ and module with a
# __main__ guard): the show command and the LM's benchmark (python -m tgattn show / tgattn.lm bench).
COMMANDS = {"tgattn.analysis.show", "tgattn.lm.bench"}
# A benchmark is a bench module with a command line, a bench package with a __main__ (the command
# and its parts: bench/gpu/, bench/gnn/, ...), or the LM's; the other bench modules are what
# benchmarks share (measure, report, models, patterns, peers, ...). No module imports a benchmark
# but its own parts and the __main__ of a command line that runs it.
LM_BENCHMARK = "tgattn.lm.bench"


def module_files(root: Path = PACKAGE):
    """Dotted module name -> file, for every ``.py`` below ``root`` (a package is its ``__init__``)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(name: str, modules) -> str:
    """The module that defines ``name``: ``name`` itself, else its longest module prefix."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts)


def _strings(node):
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def imports(module: str, path: Path, modules):
    """``[(imported module, line)]`` of every import of tgattn in ``path``, at any depth, plus the
    names a lazy package exports (``lazy_exports``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            # ``from x import y``: y is the submodule x.y when there is one, else a name of x
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports":
            # every string of the table: the submodules it names, and public names that resolve
            # to the package itself (no edge)
            names = [f"{module}.{target}" for target in _strings(node.args[1])]
        for name in names:
            if name == "tgattn" or name.startswith("tgattn."):
                target = _resolve(name, modules)
                if target and target != module:
                    found.append((target, node.lineno))
    return found


def graph(root: Path = PACKAGE):
    modules = module_files(root)
    return modules, {m: imports(m, p, modules) for m, p in modules.items()}


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def runs_as_main(path: Path) -> bool:
    return "if __name__ == \"__main__\":" in path.read_text()


def layer_of(module: str, modules) -> int:
    if module.endswith(".__main__") or module in COMMANDS or runs_as_main(modules[module]):
        return len(LAYERS) - 1
    best, rank = "", None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, rank = prefix, i
    return rank


def cycles(edges):
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child, _ in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges.get(child, ()))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)
    return found


def cycle_problems(modules, edges):
    problems = []
    for component in cycles(edges):
        links = sorted({f"{rel(modules[a])}:{line} imports {rel(modules[b])}"
                        for a in component for b, line in edges[a] if b in component})
        problems.append("import cycle: " + "; ".join(links))
    return problems


def layer_problems(modules, edges):
    problems = []
    for a, targets in edges.items():
        for b, line in sorted(set(targets)):
            la, lb = layer_of(a, modules), layer_of(b, modules)
            if lb > la:
                problems.append(f"{rel(modules[a])}:{line} ({LAYERS[la][0]}) imports {rel(modules[b])}, "
                                f"a layer above it ({LAYERS[lb][0]})")
    return problems


def benchmark_of(module: str, modules):
    """The benchmark ``module`` belongs to (a module, or the package of a benchmark with parts), else None."""
    if module == LM_BENCHMARK:
        return module
    if not module.startswith("tgattn.bench."):
        return None
    package = ".".join(module.split(".")[:3])  # tgattn.bench.<command>
    if package + ".__main__" in modules:
        return package
    return module if runs_as_main(modules[module]) else None


def bench_problems(modules, edges):
    problems = []
    for a, targets in edges.items():
        for b, line in sorted({(b, line) for b, line in targets}):
            benchmark = benchmark_of(b, modules)
            if benchmark and benchmark != benchmark_of(a, modules) and not a.endswith(".__main__"):
                problems.append(f"{rel(modules[a])}:{line} imports the benchmark {rel(modules[b])} "
                                "(share the code through a module without a command line: measure, report, models)")
    return problems


def test_every_module_has_a_layer():
    modules, _ = graph()
    assert [m for m in modules if layer_of(m, modules) is None] == []


def test_no_import_cycle():
    modules, edges = graph()
    assert cycle_problems(modules, edges) == []


def test_nothing_imports_upward():
    modules, edges = graph()
    assert layer_problems(modules, edges) == []


def test_no_benchmark_imports_another():
    modules, edges = graph()
    assert bench_problems(modules, edges) == []


def engine_imports_of_layers(modules, edges):
    """``file:line imports file`` for each import of the engine by a module of ``tgattn.nn``: the layers
    reach the engine through :mod:`tgattn.functional` and the prepared-set API (:mod:`tgattn.edgeset`)."""
    return [f"{rel(modules[a])}:{line} imports {rel(modules[b])}" for a, targets in edges.items()
            if a == "tgattn.nn" or a.startswith("tgattn.nn.")
            for b, line in sorted(set(targets)) if b == "tgattn.engine" or b.startswith("tgattn.engine.")]


def test_no_layer_imports_the_engine():
    modules, edges = graph()
    assert engine_imports_of_layers(modules, edges) == []


def test_a_layer_importing_the_engine_is_named(tmp_path, monkeypatch):
    import test_layering

    fake = tmp_path / "tgattn"
    _write(fake, {
        "__init__.py": "", "functional.py": "", "engine/__init__.py": "", "engine/native.py": "",
        "nn/__init__.py": "", "nn/conv.py": "from .. import functional\ndef f():\n    from ..engine.native import x\n",
    })
    monkeypatch.setattr(test_layering, "REPO", tmp_path)
    modules, edges = graph(fake)
    assert engine_imports_of_layers(modules, edges) == ["tgattn/nn/conv.py:3 imports tgattn/engine/native.py"]


def _write(root: Path, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_name_both_files_of_a_cycle_an_upward_import_and_a_benchmark_import(tmp_path, monkeypatch):
    """The checks on a small tree: each kind of fault is found, with both files and the line."""
    import test_layering

    fake = tmp_path / "tgattn"
    _write(fake, {
        "__init__.py": "",
        "engine/__init__.py": "",
        "engine/dense.py": "def f():\n    from ..nn import conv\n",  # an upward import, deferred
        "nn/__init__.py": "",
        "nn/conv.py": "from ..builders import a\n",
        "builders/__init__.py": "",
        "builders/a.py": "from . import b\n",
        "builders/b.py": "import tgattn.builders.a\n",  # a cycle with a.py
        "bench/__init__.py": "",
        "bench/one.py": "from .two import x\n",  # a benchmark importing another
        "bench/two.py": "x = 1\nif __name__ == \"__main__\":\n    pass\n",
        "bench/__main__.py": "from .two import x\n",  # the suite's command line runs it: allowed
        "bench/three/__init__.py": "",  # a benchmark with parts
        "bench/three/__main__.py": "from .command import main\nif __name__ == \"__main__\":\n    main()\n",
        "bench/three/command.py": "from .part import y\nfrom ..patterns import z\n",  # its own part, a shared module
        "bench/three/part.py": "y = 1\n",
        "bench/patterns.py": "from .three.part import y\n",  # a shared module importing a benchmark's part
    })
    monkeypatch.setattr(test_layering, "REPO", tmp_path)
    modules, edges = graph(fake)
    assert cycle_problems(modules, edges) == [
        "import cycle: tgattn/builders/a.py:1 imports tgattn/builders/b.py; "
        "tgattn/builders/b.py:1 imports tgattn/builders/a.py"
    ]
    assert layer_problems(modules, edges) == [
        "tgattn/engine/dense.py:2 (engine) imports tgattn/nn/conv.py, a layer above it (nn)"
    ]
    assert bench_problems(modules, edges) == [
        "tgattn/bench/one.py:1 imports the benchmark tgattn/bench/two.py "
        "(share the code through a module without a command line: measure, report, models)",
        "tgattn/bench/patterns.py:1 imports the benchmark tgattn/bench/three/part.py "
        "(share the code through a module without a command line: measure, report, models)",
    ]


def test_the_package_top_holds_at_most_five_loose_modules():
    """A newcomer's first look at the package: the rooms, and few modules beside them (no re-exports
    of moved modules: an unreleased package keeps one path per name)."""
    loose = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(loose) <= 5, loose
