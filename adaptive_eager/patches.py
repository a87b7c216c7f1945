"""Every monkeypatch of torch or a library, in one list.

Note [Patches]: where PyTorch (or a framework) offers no hook for what a device must change, we
replace one of its attributes. Each replacement goes through `patch`, which
- applies it once: a second call finds its own value in place and changes nothing (the modules
  that patch run their install functions again after a reset, or from several entry points);
- records it in `PATCHES`, in the order applied, with the private API it rests on, so that a
  PyTorch upgrade is checked against one list (tests/tools/test_patches.py asserts each is in
  place).
Patches of modules we do not import ourselves (torch._dynamo, Lightning, the pipelining and
checkpoint packages) wait for the user's import through `after_import`.

Nothing of ours is imported here: every wing may use it.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable

_MISSING = object()


@dataclass
class Patch:
    owner: Any  # the module or class whose attribute is replaced
    name: str
    original: Any  # what was there (_MISSING: nothing)
    new: Any
    rests_on: str  # the private API or behaviour the patch relies on

    @property
    def where(self) -> str:
        owner = getattr(self.owner, "__qualname__", None) or self.owner.__name__
        module = getattr(self.owner, "__module__", None)
        if isinstance(self.owner, type) and module:
            owner = f"{module}.{owner}"
        return f"{owner}.{self.name}"

    def in_place(self) -> bool:
        return inspect.getattr_static(self.owner, self.name, _MISSING) is self.new


PATCHES: list[Patch] = []  # in the order applied


def _find(owner, name) -> Patch | None:
    for p in PATCHES:
        if p.owner is owner and p.name == name:
            return p
    return None


def is_patched(owner, name) -> bool:
    """Our value is in place at `owner.name`."""
    p = _find(owner, name)
    return p is not None and p.in_place()


def patch(owner, name: str, new: Any = _MISSING, *, wrap: Callable[[Any], Any] | None = None,
          rests_on: str) -> Any:
    """Set `owner.name` to `new`, or to `wrap(the current value)`, unless our value is already
    there; return the value in place. `rests_on` names the private API (or behaviour) it
    relies on."""
    if (new is _MISSING) == (wrap is None):
        raise TypeError("patch() takes either `new` or `wrap`")
    if not rests_on:
        raise TypeError(f"patch({name!r}): say what it rests on")
    found = _find(owner, name)
    if found is not None and found.in_place():
        return found.new
    original = getattr(owner, name, _MISSING)
    if wrap is not None:
        new = wrap(original)
    setattr(owner, name, new)
    if found is not None:  # put back by someone since: ours again, one entry
        found.original, found.new = original, new
    else:
        PATCHES.append(Patch(owner, name, original, new, rests_on))
    return new


def applied() -> list[Patch]:
    """The patches made so far, in order."""
    return list(PATCHES)


def after_import(module_name: str, fn: Callable[[Any], None]):
    """`fn(module)` once `module_name` is imported: now if it is, else right after its import
    has run (a meta-path hook that finds nothing itself: it asks the finders after it and
    wraps that loader's `exec_module`, once; a module whose import is under way, its spec:
    `_when_made`). Used for modules we must not import ourselves (torch._dynamo takes
    seconds; Lightning is the user's to import). Returns the meta-path hook (None: ran at
    once, or follows a module under way), which `sys.meta_path.remove` cancels."""
    module = sys.modules.get(module_name)
    if module is not None:
        spec = getattr(module, "__spec__", None)
        if getattr(spec, "_initializing", False):
            _when_made(spec, fn)
        else:
            fn(module)
        return None
    hook = _AfterImport(module_name, fn)
    sys.meta_path.insert(0, hook)
    return hook


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, exec_module, fn = spec.loader, spec.loader.exec_module, self.fn

        def exec_then_call(module):
            try:
                exec_module(module)
            finally:
                loader.__dict__.pop("exec_module", None)  # the loader's own again
            fn(module)
        loader.exec_module = exec_then_call  # this loader instance only
        return spec


def _when_made(spec, fn) -> None:
    """`fn(module)` once the import under way of `spec`'s module has run its code: importlib
    (`_load_unlocked`, private) sets `spec._initializing = False` then, which `_Made`'s
    property sees (the spec's class for that time only). Not if the import failed."""
    spec.__dict__.setdefault("_ae_then", []).append(fn)
    if not isinstance(spec, _Made):
        spec.__class__ = type(f"_Made{type(spec).__name__}", (_Made, type(spec)), {})


class _Made:
    @property
    def _initializing(self):
        return self.__dict__.get("_initializing", False)

    @_initializing.setter
    def _initializing(self, value):
        self.__dict__["_initializing"] = value
        if value:
            return
        self.__class__ = self.__class__.__bases__[1]  # its own class again
        then = self.__dict__.pop("_ae_then", [])
        module = sys.modules.get(self.name)  # (gone: the import failed)
        for fn in then if module is not None else ():
            fn(module)
