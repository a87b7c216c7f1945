"""Where the user's code is: the frame outside our packages that issued an op (for warnings'
`stacklevel` and for the source line named by deferred errors)."""
from __future__ import annotations

import os
import re
import sys
import traceback

import torch

from .. import config as _config

DEVICE_TYPE = "neuron"  # torch.device(DEVICE_TYPE) once registered
# our three packages (installed side by side) and torch
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # adaptive_eager/
_SKIP_FILES = tuple(d + os.sep for d in (
    os.path.dirname(torch.__file__), _PACKAGE,
    os.path.join(os.path.dirname(_PACKAGE), "fusion"),
    os.path.join(os.path.dirname(_PACKAGE), "device")))
_SKIP_FILES += ("<frozen", os.path.join(os.path.dirname(os.__file__), "contextlib.py"))



def _user_stacklevel() -> int:
    """The `stacklevel` that points a warning at the user's line, not at our frames."""
    f, level = sys._getframe(1), 1
    while f is not None and _ours(f.f_code):
        f, level = f.f_back, level + 1
    return level



def _ours(code) -> bool:
    """Is `code` in our packages (or torch's)?"""
    return _kind(code) == _OUR_CODE


def _kind(code) -> int:
    """_OUR_CODE (our packages' or torch's), _FX_CODE (an FX graph module's generated code:
    compiled graphs, make_fx) or _USER_CODE. Cached by the code object's id, the object kept
    alive beside it (so the id is not reused): hashing a code object hashes its constants,
    and this runs per frame of every op."""
    kind = _KINDS.get(id(code))
    if kind is not None:
        return kind[1]
    if len(_KINDS) >= 10_000:  # code made at run time (exec, lambdas in loops): bounded
        _KINDS.clear()
    name = code.co_filename
    kind = _OUR_CODE if name.startswith(_SKIP_FILES) else \
        _FX_CODE if name.startswith("<eval_with_key>") else _USER_CODE
    _KINDS[id(code)] = (code, kind)
    return kind


_USER_CODE, _OUR_CODE, _FX_CODE = 0, 1, 2
_KINDS: dict = {}  # id(code) -> (code, kind)
_FX_LINES: dict = {}  # (code, line) -> the user's (file, line) its graph node was traced at
_FRAME_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def _source(ours: int = 1):
    """Where the user's code that issued the op is: `(code, lasti, stack)`, or for a
    compiled graph's generated code `(file, line, stack)` (`file_line` makes either a file
    and line: the line is looked up only if an error names it). `ours`: how many frames
    above the caller are known to be ours (skipped without looking: Python 3.11 makes a
    frame object for every frame a walk steps through, and this runs per op)."""
    f = sys._getframe(1 + ours)
    while f is not None:  # (_kind, inlined: this runs per op)
        code = f.f_code
        kind = _KINDS.get(id(code))
        kind = kind[1] if kind is not None else _kind(code)
        if kind != _OUR_CODE:
            break
        f = f.f_back
    if f is None:
        return None
    stack = "".join(traceback.format_stack(f)) if _config.config.stack_trace else None
    if kind == _FX_CODE:  # a compiled graph's generated code: the line it was traced at
        where = _fx_line(f)
        if where is not None:
            return where + (stack,)
    return (code, f.f_lasti, stack)


def file_line(source):
    """`(file, line, stack)` of a source `_source` captured (None stays None)."""
    if source is None or type(source[0]) is str:
        return source
    code, lasti, stack = source
    for start, end, line in code.co_lines():  # (what frame.f_lineno does)
        if start <= lasti < end and line is not None:
            return (code.co_filename, line, stack)
    return (code.co_filename, code.co_firstlineno, stack)


def _fx_line(f):
    """The user's (file, line) that the graph node running in FX frame `f` was traced at
    (the node's stack_trace, innermost frame outside torch and us), or None."""
    key = (f.f_code, f.f_lineno)
    if key not in _FX_LINES:
        if len(_FX_LINES) >= 10_000:
            _FX_LINES.clear()
        where = None
        gm = f.f_locals.get("self")
        lines = getattr(gm, "_lineno_map", None)
        if lines:
            i = lines.get(f.f_lineno - getattr(gm, "_prologue_start", 0))
            nodes = list(gm.graph.nodes) if i is not None else ()
            trace = nodes[i].meta.get("stack_trace") if i is not None and i < len(nodes) else None
            for file, line in reversed(_FRAME_LINE.findall(trace or "")):
                if not file.startswith(_SKIP_FILES):
                    where = (file, int(line))
                    break
        _FX_LINES[key] = where
    return _FX_LINES[key]




def where(source) -> str:
    """"file:line" of a source `_source` captured ("?" for none)."""
    fl = file_line(source)
    return "?" if fl is None else f"{fl[0]}:{fl[1]}"


def lines(sources) -> dict:
    """{"file:line": ops} of a launch's ops' sources, in first-seen order. Resolved only here,
    when a report or trace asks: recording keeps the raw sources."""
    out: dict = {}
    for s in sources:
        k = where(s)
        out[k] = out.get(k, 0) + 1
    return out
