"""Imports go one way: adaptive_eager -> fusion -> device (DESIGN.md). Settings, errors, meta
inference and source lookup never import the engine; nothing is filled in from outside."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"device": set(), "fusion": {"device"}, "adaptive_eager": {"fusion", "device"}}
# modules of adaptive_eager that sit below the engine and must not import it
BELOW_ENGINE = ["config", "errors", "meta", "source", "_tensor", "_storage", "templates",
                "transfer", "fallback", "results", "queue"]


def _imports(path: Path) -> set[str]:
    """Top-level names of the packages a module imports (relative imports: its own)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                out.add(path.parent.name)
                out |= {f"{path.parent.name}.{a.name}" for a in node.names}
                if node.module:
                    out.add(f"{path.parent.name}.{node.module}")
            else:
                out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_imports_point_one_way(package):
    others = set(LAYERS) - {package} - LAYERS[package]
    for path in sorted((ROOT / package).glob("*.py")):
        bad = {m for m in _imports(path) if m.split(".")[0] in others}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)} against the layering"


@pytest.mark.parametrize("module", BELOW_ENGINE)
def test_lower_modules_do_not_import_the_engine(module):
    names = _imports(ROOT / "adaptive_eager" / f"{module}.py")
    assert "adaptive_eager._engine" not in names and "_engine" not in names, names


def _filled_from_outside(path: Path) -> list[str]:
    """`module.name = value` where `module` is one of our modules this file imported."""
    tree = ast.parse(path.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {(a.asname or a.name).split(".")[0] for a in node.names
                        if a.name.split(".")[0] in LAYERS}
        elif isinstance(node, ast.ImportFrom) and node.level and not node.module:
            modules |= {a.asname or a.name for a in node.names}  # from . import _engine
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
    bad = [b for path in sorted((ROOT / package).glob("*.py")) for b in _filled_from_outside(path)]
    assert not bad, bad
