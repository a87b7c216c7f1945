"""Where the user's code is: the frame outside our packages that issued an op (for warnings'
`stacklevel` and for the source line named by deferred errors)."""
from __future__ import annotations

import os
import sys
import traceback

import torch

import device as _dev
import fusion

from . import config as _config

DEVICE_TYPE = "neuron"  # torch.device(DEVICE_TYPE) once registered
_SKIP_FILES = tuple(os.path.dirname(m.__file__) + os.sep
                    for m in (torch, _dev, fusion, sys.modules[__package__]))
_SKIP_FILES += ("<frozen", os.path.join(os.path.dirname(os.__file__), "contextlib.py"))



def _user_stacklevel() -> int:
    """The `stacklevel` that points a warning at the user's line, not at our frames."""
    f, level = sys._getframe(1), 1
    while f is not None and _ours(f.f_code):
        f, level = f.f_back, level + 1
    return level



def _ours(code) -> bool:
    """Is `code` in our packages (or torch's)? Cached per code object: this runs per op."""
    skip = _OURS.get(code)
    if skip is None:
        if len(_OURS) >= 10_000:  # code made at run time (exec, lambdas in loops): bounded
            _OURS.clear()
        skip = _OURS[code] = code.co_filename.startswith(_SKIP_FILES)
    return skip


_OURS: dict = {}


def _source():
    """(file, line, stack) of the user's code that issued the op."""
    f = sys._getframe(2)
    while f is not None and _ours(f.f_code):
        f = f.f_back
    if f is None:
        return None
    stack = None
    if _config.config.stack_trace:
        stack = "".join(traceback.format_stack(f))
    return (f.f_code.co_filename, f.f_lineno, stack)


