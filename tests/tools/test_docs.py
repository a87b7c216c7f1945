"""Every back-reference resolves: each `Note [Name]` cited in code or docs is listed in the
Notes index (adaptive_eager/README.md, "Notes") and defined, as `Note [Name]:`, in the file
the index gives (and in the file a citation names, when it names one); every cited document
(`*.md`) exists; every relative link of the READMEs resolves, anchors included; the settings
table names every setting of config.py."""
import dataclasses
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = ("adaptive_eager", "fusion", "device", "tests", "benchmarks")
INDEX = ROOT / "adaptive_eager" / "README.md"
# Documents being written on other branches this session, linked before they land. Enforced
# both ways: once one exists, the test fails until it is removed from here.
PENDING: set[str] = set()

NOTE = re.compile(r"Note\s+\[([^\]]+)\]")
# A citation naming its file: "Note [X] in fusion/program.py", "Note [Threads] at exit in ..."
NOTE_IN = re.compile(r"Note\s+\[([^\]]+)\](?:\s+[a-z.]+(?:\s+[a-z.]+)?)?"
                     r"\s+in\s+`?([\w/]+\.(?:py|md))")
DOC = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[A-Z][A-Z_]+\.md|(?:[\w-]+/)+[\w-]+\.md)\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _name(raw: str) -> str:
    """A Note's name, also when a comment wraps it (`Note [Collective\n    # stream]`)."""
    return " ".join(w for w in raw.split() if w != "#")


def _files():
    out = [ROOT / "README.md"] + sorted(ROOT.glob("*.py"))  # (the pytest plugin's module)
    for top in SOURCES:
        out += sorted(p for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".md")
                      and "__pycache__" not in p.parts and p != pathlib.Path(__file__))
    return out


def _index() -> dict[str, str]:
    rows = re.findall(r"^\| Note \[([^\]]+)\] \| `([^`]+)` \|$", INDEX.read_text(), re.M)
    assert rows, "the Notes index in adaptive_eager/README.md has no rows"
    return dict(rows)


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def test_every_cited_note_is_indexed_and_defined_where_the_index_says():
    index = _index()
    problems = []
    for name, path in index.items():
        target = ROOT / path
        if not target.is_file():
            problems.append(f"index: Note [{name}] -> {path}, which does not exist")
        elif not re.search(r"Note\s+\[" + re.escape(name).replace(r"\ ", r"[\s#]+") + r"\]:",
                           target.read_text()):
            problems.append(f"index: Note [{name}] is not defined (`Note [{name}]:`) in {path}")
    for f in _files():
        text = f.read_text(errors="replace")
        rel = f.relative_to(ROOT)
        for m in NOTE.finditer(text):
            name = _name(m.group(1))
            if name not in index and name != "Name":  # "Name": the index's own wording
                problems.append(f"{rel}:{_line(text, m.start())}: Note [{name}] is not in the "
                                f"Notes index (adaptive_eager/README.md)")
        for m in NOTE_IN.finditer(text):
            name, cited = _name(m.group(1)), m.group(2)
            where = index.get(name)
            if where is not None and not where.endswith(cited):
                problems.append(f"{rel}:{_line(text, m.start())}: Note [{name}] cited in "
                                f"{cited}, but it lives in {where}")
    assert not problems, "\n".join(problems)


def test_every_indexed_note_is_used():
    """An index row whose Note no file cites any more is stale (its definition counts)."""
    used = set()
    for f in _files():
        if f != INDEX:
            used |= {_name(n) for n in NOTE.findall(f.read_text(errors="replace"))}
    assert not set(_index()) - used


def _resolve(src: pathlib.Path, target: str) -> pathlib.Path | None:
    for base in (src.parent, ROOT):
        p = (base / target).resolve()
        if p.exists():
            return p
    return None


def test_every_cited_document_exists():
    missing = []
    for f in _files():
        text = f.read_text(errors="replace")
        for m in DOC.finditer(text):
            doc = m.group(1)
            pending = {str((base / doc).resolve().relative_to(ROOT)) for base in (f.parent, ROOT)
                       if (base / doc).resolve().is_relative_to(ROOT)} & PENDING
            if _resolve(f, doc) is None and not pending:
                missing.append(f"{f.relative_to(ROOT)}:{_line(text, m.start())}: {doc}")
    assert not missing, "cited documents that are not in the repository:\n" + "\n".join(missing)


def _anchors(md: pathlib.Path) -> set[str]:
    """GitHub's heading slugs: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for h in re.findall(r"^#+\s+(.*)$", md.read_text(), re.M):
        out.add(re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("readme", ["README.md", "adaptive_eager/README.md", "fusion/README.md",
                                    "device/README.md", "tests/README.md",
                                    "benchmarks/README.md", "adaptive_eager/LIMITS.md",
                                    "adaptive_eager/REFERENCE.md"])
def test_relative_links_resolve(readme):
    src = ROOT / readme
    bad = []
    for target in LINK.findall(src.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        rel = str((src.parent / path).resolve().relative_to(ROOT)) if path else readme
        if rel in PENDING:
            continue
        dest = (src.parent / path).resolve() if path else src
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {rel}")
    assert not bad, f"{readme}:\n" + "\n".join(bad)


def test_pending_documents_are_still_pending():
    landed = sorted(p for p in PENDING if (ROOT / p).exists())
    assert not landed, f"{landed} exist now: remove them from PENDING in this file"


def test_settings_table_names_every_setting():
    from adaptive_eager.config import Config
    table = INDEX.read_text().split("## Settings", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| ([A-Z0-9_]+) \|", table, re.M))
    declared = {f.metadata["var"] for f in dataclasses.fields(Config)}
    assert declared - listed == set(), f"settings missing from the table: {declared - listed}"
    assert listed - declared == set(), f"table rows that are no setting: {listed - declared}"
