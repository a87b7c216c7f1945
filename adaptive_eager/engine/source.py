"""Where the user's code is: the frame outside our packages that issued an op (for warnings'
`stacklevel` and for the source line named by deferred errors)."""
from __future__ import annotations

import os
import re
import sys
import traceback

import torch

from .. import config as _config

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
    return _kind(code) & 1 == 1  # _OUR_CODE or _BACKWARD_CODE


def _kind(code) -> int:
    """_OUR_CODE (our packages' or torch's; _BACKWARD_CODE for torch's function that runs
    autograd's engine), _FX_CODE (an FX graph module's generated code: compiled graphs,
    make_fx) or _USER_CODE. Cached by the code object's id, the object kept
    alive beside it (so the id is not reused): hashing a code object hashes its constants,
    and this runs per frame of every op."""
    kind = _KINDS.get(id(code))
    if kind is not None:
        return kind[1]
    if len(_KINDS) >= 10_000:  # code made at run time (exec, lambdas in loops): bounded
        _KINDS.clear()
    name = code.co_filename
    kind = (_BACKWARD_CODE if code.co_name == "_engine_run_backward" else _OUR_CODE) \
        if name.startswith(_SKIP_FILES) else \
        _FX_CODE if name.startswith("<eval_with_key>") else _USER_CODE
    _KINDS[id(code)] = (code, kind)
    return kind


# (ours: odd) _BACKWARD_CODE: torch's frame that runs autograd's engine (Note [Backward lines])
_USER_CODE, _OUR_CODE, _FX_CODE, _BACKWARD_CODE = 0, 1, 2, 3
_KINDS: dict = {}  # id(code) -> (code, kind)
_FX_LINES: dict = {}  # (code, line) -> the user's (file, line) its graph node was traced at
_FRAME_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def _source(ours: int = 1):
    """Where the user's code that issued the op is: `(code, lasti, stack)`, or for a
    compiled graph's generated code `(file, line, stack)` (`file_line` makes either a file
    and line: the line is looked up only if an error names it), or for an op autograd runs
    in backward `(BACKWARD, the forward op's source)` (Note [Backward lines]). `ours`: how
    many frames above the caller are known to be ours (skipped without looking: Python 3.11
    makes a frame object for every frame a walk steps through, and this runs per op)."""
    try:
        f = sys._getframe(1 + ours)
    except ValueError:  # fewer frames than ours: called from C++ on a thread of its own
        f = None
    backward = False
    while f is not None:  # (_kind, inlined: this runs per op)
        code = f.f_code
        kind = _KINDS.get(id(code))
        kind = kind[1] if kind is not None else _kind(code)
        if kind != _OUR_CODE:
            if kind != _BACKWARD_CODE:
                break
            backward = True  # autograd runs backward (Note [Backward lines])
        f = f.f_back
    if backward or f is None:  # (no Python frame: autograd's device thread)
        grad = _current_autograd_node()
        if grad is not None:  # in backward: the forward line (Note [Backward lines])
            fwd = _GRAD_LINES.get(grad._sequence_nr())
            if fwd is not None:
                return (BACKWARD, fwd)
    if f is None:
        source = None
    else:
        stack = "".join(traceback.format_stack(f)) if _config.config.stack_trace else None
        source = (code, f.f_lasti, stack)
        if kind == _FX_CODE:  # a compiled graph's generated code: the line it was traced at
            where = _fx_line(f)
            if where is not None:
                source = where + (stack,)
    seq = _sequence_nr()
    if seq != _LAST_SEQ[0]:  # this op made an autograd node (Note [Backward lines])
        _made_node(seq, source)
    return source


def _made_node(seq: int, source):
    """Note `source` as the forward line of autograd node number `seq - 1`."""
    _LAST_SEQ[0] = seq
    if len(_GRAD_LINES) >= _GRAD_LIMIT:  # bounded: the newest half stays
        keep = list(_GRAD_LINES.items())[_GRAD_LIMIT // 2:]
        _GRAD_LINES.clear()
        _GRAD_LINES.update(keep)
    _GRAD_LINES[seq - 1] = source


# Note [Backward lines]: an op autograd runs in backward is attributed to the forward op it
# differentiates, as anomaly mode does, but without a traceback per node. Autograd numbers
# each node it makes (a thread's sequence number, taken when the node is made, before its
# forward op is dispatched to us); an op that sees the counter moved since the last op
# made that node, and notes its source under the number (`_GRAD_LINES`; the first op after
# the node wins: a node's forward may issue several ops, of one line). An op runs in
# backward when the frame walk, before reaching user code, passes torch's
# `_engine_run_backward` (or finds no Python frame: autograd's device thread); then
# `torch._C._current_autograd_node()` is the node being run, and its `_sequence_nr()` finds
# the forward line. Such a source is `(BACKWARD, forward source)`: `where` names it
# "file:line (backward)", errors name the forward line. Ops issued by user code in backward
# (a hook, an autograd.Function's backward) keep that code's line: the walk stops there.
# A compiled graph's backward runs in its generated code (the walk stops there too): its
# traced lines. Cost per op: one C call (the sequence number) and a compare; per node made,
# a dict store; per backward op, a C call and a lookup. Limits: an op not issued from a
# node's forward (a CPU op made the node) may be noted for it; forward on several threads
# shares the table (numbers are per thread); the table keeps the newest 8k..16k nodes.
BACKWARD = object()
_GRAD_LINES: dict = {}  # autograd node's sequence number -> the source of the op that made it
_GRAD_LIMIT = 16384  # at most ~2.7 MB (measured: 16k entries of a 3-tuple source)
_LAST_SEQ = [-1]
_current_autograd_node = torch._C._current_autograd_node
_sequence_nr = torch._C._autograd._get_sequence_nr


def file_line(source):
    """`(file, line, stack)` of a source `_source` captured (None stays None; a backward
    op's: its forward op's)."""
    if source is not None and source[0] is BACKWARD:
        source = source[1]
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
    if fl is None:
        return "?"
    return f"{fl[0]}:{fl[1]} (backward)" if source[0] is BACKWARD else f"{fl[0]}:{fl[1]}"


def lines(sources) -> dict:
    """{"file:line": ops} of a launch's ops' sources, in first-seen order. Resolved only here,
    when a report or trace asks: recording keeps the raw sources."""
    out: dict = {}
    for s in sources:
        k = where(s)
        out[k] = out.get(k, 0) + 1
    return out
