"""The native hooks: what PyTorch asks only of a C++ backend (csrc/neuron_hooks.cpp).

Note [Native hooks]: some of PyTorch's questions to a backend have no Python answer: the
current device of an index-less "neuron" (`.to("neuron")`, `torch.tensor(..., device=
"neuron")`), per thread; a pinned host allocator (`pin_memory=True`, DDP's reducer); device
generators (`torch.Generator(device="neuron")`). A small C++ extension answers them for
PrivateUse1 (as PyTorch's reference backend torch_openreg does); Python stays the engine.

It is built at first import with `torch.utils.cpp_extension.load` against the torch that is
running (never another: no build isolation), into the user's cache directory
(`$XDG_CACHE_HOME/adaptive_eager/native/` or ~/.cache/...), keyed by torch version, Python
version and the source's hash; later imports load the built library. No C++ compiler, a build
that fails, or ADAPTIVE_EAGER_NATIVE=0: the package works without it (the Python device guard
and hooks PyTorch offers, and the Python pinned-memory path), with one warning naming what is
missing. The guard and hooks must be registered before PyTorch's Python ones (each is
registered once per process): registration installs them first.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
import warnings

import torch

from .. import config as _config

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "neuron_hooks.cpp")
_module = None  # the loaded extension, once install() succeeded
_why_not = None  # why it is not loaded (a sentence), or None


def build_dir() -> str:
    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-{digest}"
    return os.path.join(base, "adaptive_eager", "native", tag)


def _load():
    """The built extension (building it first when needed), or raise saying why not."""
    from torch.utils import cpp_extension
    where = build_dir()
    os.makedirs(where, exist_ok=True)
    name = "adaptive_eager_native"
    lib = os.path.join(where, name + ".so")
    # Built before (the directory's key says it is current) and no build running (another
    # process holds torch's "lock" file while it builds: cpp_extension.load waits for it)
    if os.path.exists(lib) and not os.path.exists(os.path.join(where, "lock")):
        import importlib.util
        spec = importlib.util.spec_from_file_location(name, lib)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod._build_seconds = None
        return mod
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ('{cxx}' is not on PATH; install g++ or set CXX)")
    path = os.environ.get("PATH", "")
    try:
        os.environ["PATH"] = _with_ninja(path)
        print(f"adaptive_eager: building the native hooks for torch {torch.__version__} (once; "
              f"15-60 s) in {where}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        mod = cpp_extension.load(name=name, sources=[_SOURCE], build_directory=where,
                                 extra_cflags=["-O2"], verbose=False)
    finally:
        os.environ["PATH"] = path
    mod._build_seconds = time.perf_counter() - t0
    return mod


def _with_ninja(path: str) -> str:
    """`path` with a `ninja` on it: torch's build runs `ninja` from PATH. The `ninja` package
    (a dependency) puts one beside the interpreter, which is not on PATH when a venv's python
    runs unactivated: then its directory goes first, for the build only."""
    if shutil.which("ninja", path=path) is not None:
        return path
    try:
        import ninja
    except ImportError:
        ninja = None
    if ninja is not None and shutil.which("ninja", path=ninja.BIN_DIR) is not None:
        return ninja.BIN_DIR + os.pathsep + path
    raise RuntimeError("no ninja, which torch's C++ build needs (`pip install ninja`, or the "
                       "system's ninja-build package)")


def install(count: int, sync, rng) -> bool:
    """Build or load the extension and register its device guard and hooks (before
    PyTorch's Python ones). False, with one warning naming what is missing, when it cannot."""
    global _module, _why_not
    if _module is not None:
        return True
    if not _config.config.native:
        _why_not = "ADAPTIVE_EAGER_NATIVE=0"
        return False
    try:
        mod = _load()
        mod.install(count, sync, rng)
    except Exception as e:  # noqa: BLE001 (any build or load failure: go without it)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        _why_not = f"the native hooks could not be built or loaded: {first}"
        warnings.warn(
            f"adaptive_eager: {_why_not}. The neuron device works without them, but "
            f"`pin_memory=True`, `torch.Generator(device='neuron')`, a per-thread current "
            f"core and `set_device` for index-less 'neuron' devices are not available (set "
            f"ADAPTIVE_EAGER_NATIVE=0 to silence this).", RuntimeWarning, stacklevel=2)
        return False
    _module = mod
    return True


def loaded() -> bool:
    return _module is not None


def module():
    return _module


def why_not() -> str | None:
    return _why_not
