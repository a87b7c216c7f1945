"""A fixture is written once: two test files defining fixtures with the same body share one
(a conftest.py fixture the files ask for, or `tests/harness`)."""
import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _is_fixture(node) -> bool:
    return any("fixture" in ast.unparse(d) for d in node.decorator_list)


def test_no_fixture_body_is_written_in_two_files():
    where = collections.defaultdict(set)
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and _is_fixture(node):
                body = node.body[1:] if ast.get_docstring(node) else node.body
                where[ast.dump(ast.Module(body=body, type_ignores=[]))].add(
                    f"{path.relative_to(ROOT)}::{node.name}")
    twice = sorted(sorted(v) for v in where.values() if len({s.split("::")[0] for s in v}) > 1)
    assert not twice, f"fixtures written more than once: {twice}"
