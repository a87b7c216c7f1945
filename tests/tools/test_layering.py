"""Imports go one way (adaptive_eager/README.md, "Layout"): adaptive_eager -> fusion -> device,
and inside adaptive_eager: tools -> integration -> engine. Settings, errors, meta inference and
source lookup never import the engine; nothing is filled in from outside; the module import
graph has no circle and few floors."""
import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = {"device": set(), "fusion": {"device"}, "adaptive_eager": {"fusion", "device"}}
# wings of adaptive_eager and the wings each may import (top-level modules: config, errors,
# metrics, explain, __init__, __main__ may be imported by any wing)
WINGS = {"engine": set(), "integration": {"engine"}, "tools": {"engine", "integration"}}
# modules of the engine wing (or the top) that sit below the engine and must not import it
BELOW_ENGINE = ["config", "patches", "errors", "engine/meta", "engine/source", "engine/tensor",
                "engine/storage", "engine/templates", "engine/transfer", "engine/fallback",
                "engine/results", "engine/queue"]
MAX_FLOORS = 10  # issue 26: at most 10


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path, top_only: bool = False) -> set[str]:
    """Dotted names of the modules (or packages) a module imports, relative imports resolved;
    with top_only, only the imports at module level (not the deferred ones in functions)."""
    package = _name(path) if path.name == "__init__.py" else _name(path).rpartition(".")[0]
    tree = ast.parse(path.read_text())
    out = set()
    for node in (tree.body if top_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_imports_point_one_way(package):
    others = set(LAYERS) - {package} - LAYERS[package]
    for path in _modules(package):
        bad = {m for m in _imports(path) if m.split(".")[0] in others}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)} against the layering"


@pytest.mark.parametrize("wing", sorted(WINGS))
def test_wings_import_one_way(wing):
    others = set(WINGS) - {wing} - WINGS[wing]
    for path in _modules(f"adaptive_eager/{wing}"):
        bad = {m for m in _imports(path)
               if len(m.split(".")) > 1 and m.split(".")[0] == "adaptive_eager"
               and m.split(".")[1] in others}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)} against the wings"


@pytest.mark.parametrize("module", BELOW_ENGINE)
def test_lower_modules_do_not_import_the_engine(module):
    names = _imports(ROOT / "adaptive_eager" / f"{module}.py")
    assert "adaptive_eager.engine.engine" not in names, names


def _facades(paths) -> set[str]:
    """Packages whose __init__ only re-exports (imports, __all__, a docstring, a lazy
    module `__getattr__`): a face, not a floor. Importing a name through one depends on the module that defines it."""
    out = set()
    for p in paths:
        if p.name == "__init__.py":
            body = ast.parse(p.read_text()).body
            if all(isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef)) or (
                    isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) or (
                    isinstance(n, ast.Assign) and n.targets[0].id == "__all__") for n in body):
                out.add(_name(p))
    return out


def import_graph() -> nx.DiGraph:
    """Module-level imports between our modules (deferred imports inside functions are not
    counted), through facades to the modules behind them."""
    paths = [p for pkg in LAYERS for p in _modules(pkg)]
    known = {_name(p) for p in paths}
    facades = _facades(paths)
    g = nx.DiGraph()
    for p in paths:
        if _name(p) in facades:
            continue
        g.add_node(_name(p))
        names = _imports(p, top_only=True) & known
        for m in names:
            if m == _name(p) or any(n.startswith(m + ".") for n in names):
                continue  # `from .. import config`: the module, not its package
            if m in facades:  # `from device import Launch`: what device/__init__ imports
                m_path = ROOT / (m.replace(".", "/") + "/__init__.py")
                behind = _imports(m_path, top_only=True) & known
                g.add_edges_from((_name(p), b) for b in behind - facades)
            else:
                g.add_edge(_name(p), m)
    return g


def test_the_import_graph_is_a_house_not_a_tower():
    """At module level, modules import each other only downwards: no circle, and at most
    MAX_FLOORS floors."""
    g = import_graph()
    cycles = list(nx.simple_cycles(g))
    assert not cycles, cycles[:5]
    assert nx.dag_longest_path_length(g) + 1 <= MAX_FLOORS, nx.dag_longest_path(g)


def _filled_from_outside(path: Path) -> list[str]:
    """`module.name = value` where `module` is one of our modules this file imported."""
    tree = ast.parse(path.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {(a.asname or a.name).split(".")[0] for a in node.names
                        if a.name.split(".")[0] in LAYERS}
        elif isinstance(node, ast.ImportFrom) and node.level:  # from ..engine import engine
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            base = base.joinpath(*(node.module.split(".") if node.module else []))
            modules |= {a.asname or a.name for a in node.names
                        if (base / f"{a.name}.py").exists() or (base / a.name).is_dir()}
    bad = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                    and t.value.id in modules:
                bad.append(f"{path.name}:{node.lineno}: {t.value.id}.{t.attr} = ...")
    return bad


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_nothing_is_filled_in_from_outside(package):
    """No module sets another of our modules' globals (the engine's tensor class and device
    used to be set by the modules that define them)."""
    bad = [b for path in _modules(package) for b in _filled_from_outside(path)]
    assert not bad, bad


@pytest.mark.parametrize("module", [
    "fusion.host", "fusion.program", "fusion.flush", "device", "device.counters",
    "adaptive_eager.errors", "adaptive_eager.engine.meta", "adaptive_eager.integration.kernels"])
def test_a_module_of_ours_imported_before_torch(module):
    """`import fusion.host` before torch: torch's import loads the backend, which imports
    fusion's modules, and met fusion.host half made (`cannot import name 'QUIET_OPS' from
    partially initialized module`: torch then refused the backend). So did `import device`
    (`COUNTERS`) and `import adaptive_eager.errors` (`_quantized_error`): the API now loads
    once the module of ours half made is whole (Note [Lazy package]); the kernel library,
    which needs the device at its import, loads it itself."""
    import os
    import subprocess
    import sys
    code = (f"import {module}\nimport torch\n"
            "assert (torch.ones(2, device='neuron') + 1).cpu().tolist() == [2.0, 2.0]\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_first_imports_of_torch_and_the_package_on_two_threads():
    """Note [Lazy package]: one thread's first `import torch` and another's `import
    adaptive_eager` (then an `ae.` name) at once: the package's thread imported the API, holding
    its import lock, and waited for torch, whose autoload waited for the package; Python's
    deadlock detector broke the circle by failing one import ("Failed to load the backend
    extension: neuron", then torch's module ran twice: "Only a single TORCH_LIBRARY ... triton"),
    2 runs of 2. Each thread then uses the device."""
    import os
    import subprocess
    import sys
    code = """if True:
        import threading
        errors, go = [], threading.Barrier(2)
        def first(i):
            try:
                go.wait()
                if i:
                    import adaptive_eager as ae
                    ae.metrics()
                import torch
                assert (torch.ones(2, device="neuron") * 2).tolist() == [2.0, 2.0]
            except BaseException as e:
                errors.append(f"{i}: {type(e).__name__}: {e}"[:300])
        threads = [threading.Thread(target=first, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
