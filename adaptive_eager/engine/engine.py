"""The engine: every ATen op on a neuron tensor lands in `Engine.dispatch`.

Three steps per op (as jax's dispatch): abstract specs (meta execution, cached per
signature, so shape/dtype errors raise at the call), a queued node, and a flush that turns
queued nodes into launches. In eager mode every op flushes at once; in adaptive mode the
queue is flushed at sync points, boundaries, a full buffer, or when the device runs idle.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import threading
import warnings
import weakref
from typing import Callable, NamedTuple

import torch

from device import COUNTERS, Device, DeviceError, DeviceSpec, Launch
from fusion.cache import ExecutableCache
from fusion.executors import make_executor
from fusion.flush import FlushReport, Runner
from fusion.ir import Handle, Node, scalar_positions, written_values
from fusion.ops import BARRIER, INPLACE_VIEW, KERNEL, VIEW, composite_key, op_class
from fusion.partition import STRATEGIES
from fusion.ir import extent_bytes
from fusion import host as _host

from .. import config as _config
from . import cpu_settings, hooks, replay, results, transfer
from .. import errors
from .tensor import NeuronTensor
from ..errors import _generator_error, _raise_launch_error
from .hooks import _hand_off, in_backward
from .fallback import run_now
from .meta import (_RUN_NOW, _deterministic, _global_state, argument, check_conversions,
                   give_warnings, infer, infer_view)
from .queue import Segment, record
from .replay import MISS, MISSED
from ..config import DEVICE_TYPE
from .source import _user_stacklevel
from .templates import template

aten = torch.ops.aten


class Scopes:
    """Note [Scopes across threads]: settings scopes (`ae.override`, `ae.adaptive`) change the
    process's settings, and threads may leave them in any order. Each scope's values stay on
    a list while it is open; leaving one removes them, and each of its settings becomes the
    newest open scope's value for it, or the value from before the first scope that set it.
    (Restoring the value seen at entry instead left A's value in force inside B's scope once
    A, entered first, had exited, and A's entry value for good once B exited.) A setting no
    scope set is left alone."""

    def __init__(self, read, write):
        self.read, self.write = read, write
        self.open: list = []  # (token, values), oldest first
        self.before: dict = {}

    def enter(self, values: dict) -> object:
        with _LOCK:
            for k in values:
                if not any(k in v for _, v in self.open):
                    self.before[k] = self.read(k)
            token = object()
            self.open.append((token, values))
            try:
                self.write(values)
            except BaseException:  # a refused value (an unknown executor...): nothing changes
                self.leave(token)
                raise
            return token

    def leave(self, token) -> None:
        with _LOCK:
            values = next(v for t, v in self.open if t is token)
            self.open = [(t, v) for t, v in self.open if t is not token]
            now = {}
            for k in values:
                setters = [v[k] for _, v in self.open if k in v]
                now[k] = setters[-1] if setters else self.before.pop(k)
            self.write(now)


def _read_setting(k):
    if k == "adaptive":
        return ENGINE.adaptive
    if k == "strategy":
        return ENGINE.strategy_name
    return getattr(_config.config, k)


@contextlib.contextmanager
def override(**changes):
    """Temporarily change settings (`with ae.override(queue_low_threshold=0): ...`); the
    engine flushes, applies them, and restores them on exit (Note [Scopes across threads]).
    `adaptive` and `strategy` set the engine's mode and strategy for the block."""
    cfg = _config.config
    for k, v in changes.items():
        if not hasattr(cfg, k):
            raise AttributeError(f"no setting named {k!r}; `python -m adaptive_eager config` lists them")
        _config.check(k, v)
    if "strategy" in changes and changes["strategy"] not in STRATEGIES:
        raise ValueError(f"unknown fusion strategy {changes['strategy']!r}; choose one of "
                         f"{sorted(STRATEGIES)}")
    token = _OVERRIDES.enter(changes)
    try:
        yield cfg
    finally:
        _OVERRIDES.leave(token)


def _apply_settings(values: dict) -> None:
    with _LOCK:
        for eng in ENGINES:
            eng.flush("config")
        for k, v in values.items():
            setattr(_config.config, k, v)
        for eng in ENGINES:
            if "adaptive" in values:
                eng.adaptive = bool(values["adaptive"])
            if "strategy" in values:
                eng.strategy_name = values["strategy"]
            eng.reconfigure()


def _locked(method):
    """Run an engine entry point under the engine lock (Note [Threads])."""
    def locked(self, *args, **kwargs):
        USERS.add(_get_ident())
        with self.lock:
            return method(self, *args, **kwargs)
    locked.__name__, locked.__doc__ = method.__name__, method.__doc__
    return locked


def entry(kernel):
    """Note [Threads]: `kernel`, an entry into the engine from PyTorch's dispatcher other than
    Engine.dispatch (a kernel registered below the Python key: `torch.tensor(v,
    device="neuron")`'s copy, a factory), run under the engine lock as every entry is."""
    @functools.wraps(kernel)
    def entered(*args, **kwargs):
        USERS.add(_get_ident())
        with _LOCK:  # (read at the call: a forked child has a lock of its own)
            return kernel(*args, **kwargs)
    return entered


# Note [Threads]: one engine lock, shared by the engines of every core. Every entry point (an
# op, a host read or write, an allocation, a sync, a settings change) holds it, so the ops of
# several threads run in some serial order of each thread's ops, sharing the queues, caches
# and devices; results are bit for bit those of that order. Re-entrant: an op may allocate,
# flush and sync inside. A backward in another thread takes it per op too.
_LOCK = threading.RLock()

# Note [Threads] at exit: the threads that ever entered the engine, by ident
# (`park_daemon_threads`).
USERS: set[int] = set()
AT_SYNC: list = []  # called after each sync (integration/distributed.py's look at its Works)
_get_ident = threading.get_ident
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def park_daemon_threads(timeout: float) -> None:
    """Note [Threads] at exit: called with the engine lock held, wait (up to `timeout` s)
    until every daemon thread that ever entered the engine runs this package's code, where
    its next step is to wait on the lock in Python. A daemon thread that interpreter
    shutdown stops anywhere else may be in PyTorch's C++ frames between two of its ops, with
    the GIL released: retaking it there during finalization ends the thread by a forced
    unwind through a C++ destructor, which aborts the process ("terminate called without an
    active exception"; plain CPU PyTorch aborts so, every time, with a daemon thread busy on
    CPU ops). A thread idle elsewhere (on a queue) costs the whole timeout."""
    import sys
    import time
    deadline = time.monotonic() + timeout
    me = _get_ident()
    while time.monotonic() < deadline:
        frames = sys._current_frames()
        if all(t.ident == me or not t.daemon or t.ident not in USERS
               or (f := frames.get(t.ident)) is None
               or os.path.dirname(f.f_code.co_filename) == _PACKAGE
               for t in threading.enumerate()):
            return
        time.sleep(0.002)  # the GIL is released: a thread between ops gets on


# Note [Composite ops in inference mode]: PyTorch decomposes a CompositeImplicitAutograd op
# (`to`, `softmax`, `layer_norm`, `scaled_dot_product_attention`...) at the Autograd key. In
# inference mode, and for inference tensors, that key is skipped and the op reaches Python
# dispatch whole: run as one device op it fell back to the CPU, or, for ops whose schema says
# they may alias (`to`), was taken for a view (`.cpu()` of an inference tensor stayed on
# neuron). It runs here as autograd's key would run it: our kernel where we registered one
# (attention.sdpa, one_hot), PyTorch's decomposition otherwise, as CPU decomposes it
# (fusion.ops.composite_key). On CPU the decomposition's own calls pass the ADInplaceOrView
# key of an ordinary tensor (inference mode skips autograd's keys, not that one), so
# `y.reshape(-1)` is a view of `y` sharing its version counter; inside __torch_dispatch__
# every key above Python is excluded, so here it runs with that one key let through: a
# composite view of an ordinary tensor is an autograd view, and an in-place change of it
# makes a backward through `y` raise, as on CPU (it gave a wrong gradient).
# PyTorch's own custom ops written in torch ops for any device (F.linear_cross_entropy's
# chunked path: fusion.ops `_COMPOSITE_CUSTOM_OPS`) always reach the device whole, and run
# their CompositeExplicitAutograd kernel here the same way, their ops the device's.


_INFERENCE_WRITE = ("Inplace update to inference tensor outside InferenceMode is not allowed."
                    "You can make a clone to get a normal tensor before doing inplace update."
                    "See https://github.com/pytorch/rfcs/pull/17 for more details.")


def _composite(func, key, args, kwargs):
    """Note [Composite ops in inference mode]: the decomposition runs below PyTorch's version
    bookkeeping, so what an in-place or out= composite writes (`square_`, `clip_`) gets CPU's
    checks and bumps here: an inference tensor refused outside inference mode, an ordinary
    one's version bumped once if the decomposition did not (a backward through it raises
    "modified by an inplace operation" as on CPU, instead of a wrong gradient)."""
    if _tracks_views(func):  # (the op's own ADInplaceOrView kernel, above us, makes it one)
        return _decomposed(func, key, args, kwargs)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                         torch._C._dispatch_tls_local_exclude_set()
                                         .remove(_AD_INPLACE_OR_VIEW)):
        return _decomposed(func, key, args, kwargs)


_AD_INPLACE_OR_VIEW = torch._C.DispatchKey.ADInplaceOrView


# Note [Flushes outside inference mode]: a flush's CPU tensors over device buffers outlive it
# (Note [Host views] in fusion/codegen.py: a buffer keeps the last one), so they are made
# outside inference mode, wherever the flush happens: one made inside it is an inference
# tensor, and a later flush outside the mode that updated it in place raised "Inplace update
# to inference tensor outside InferenceMode" where CPU gives the value (a write in inference
# mode through a view of an ordinary tensor, flushed by an op of the mode in between).
def _ordinary_tensors():
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else \
        contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def _tracks_views(func) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _AD_INPLACE_OR_VIEW)


def _decomposed(func, key, args, kwargs):
    written = [t for t in written_values(func, args, kwargs) if isinstance(t, torch.Tensor)]
    if not written:
        return func._op_dk(key, *args, **kwargs)
    if not torch.is_inference_mode_enabled() and any(t.is_inference() for t in written):
        raise RuntimeError(_INFERENCE_WRITE)
    ordinary = [t for t in written if not t.is_inference()]
    before = [t._version for t in ordinary]
    out = func._op_dk(key, *args, **kwargs)
    stale = [t for t, v in zip(ordinary, before) if t._version == v]
    if stale:
        torch.autograd.graph.increment_version(stale)
    return out


class Engine:
    """The engine of one NeuronCore (Note [Cores] in integration/neuron.py): its queue, meta
    cache, executable cache and simulated device. Mode and settings are the same on every core."""

    def __init__(self, index: int = 0, spec: DeviceSpec | None = None):
        self.index = index
        self.tdev = None  # torch.device("neuron", index), made with the first tensor
        self.metrics = COUNTERS  # the one counters object (device/counters.py)
        self.seg = Segment()  # what is queued (Note [Segments] in queue.py)
        self.traces = replay.Traces()  # what replay follows (Note [Replay] in replay.py)
        self.meta_cache: dict = {}
        self._report = None  # the last flush's (`last_report`)
        self.lock = _LOCK
        self.warned: set[str] = set()  # warnings given once per process
        self.spec = spec or DeviceSpec()
        self.device = Device(self.spec)
        # The mode and strategy are the engine's state: settings give their start-up values
        # (and `override(adaptive=..., strategy=...)` sets them); nothing writes settings back.
        cfg = _config.config
        self.adaptive = cfg.adaptive
        self.strategy_name = cfg.strategy
        self.reconfigure()

    # -- configuration ---------------------------------------------------------------
    @_locked
    def reconfigure(self, spec: DeviceSpec | None = None) -> None:
        cfg = _config.config
        self.traces.forget()
        if spec is not None and spec != self.spec:
            self.flush("config")
            self.synchronize()
            self.spec = spec
            self.device.respec(spec)
        self.device.configure(blocking=cfg.launch_blocking, realtime=cfg.realtime)
        if self.strategy_name not in STRATEGIES:
            raise ValueError(f"unknown fusion strategy {self.strategy_name!r}; "
                             f"choose one of {sorted(STRATEGIES)}")
        self.strategy = STRATEGIES[self.strategy_name](self.spec, cfg.max_group_ops,
                                                       cfg.max_group_contractions)
        self.eager_strategy = STRATEGIES["none"](self.spec)  # eager: one op per launch
        cache_dir = None if cfg.disable_disk_cache else cfg.cache_dir
        salt = "|".join([_package_version(), torch.__version__, f"executor={cfg.executor}",
                         self.spec.fingerprint()])
        executor = make_executor(cfg.executor, cfg.tier_up, cfg.cache_dir)
        old = getattr(self, "runner", None)
        if old is None or old.cache.directory != cache_dir or old.device is not self.device \
                or old.cache.salt != salt or old.executor is not executor \
                or (old.cache.max_entries, old.cache.max_bytes) != (
                    cfg.cache_max_entries,
                    None if cfg.cache_max_mb is None else int(cfg.cache_max_mb * 2**20)):
            cache = ExecutableCache(cache_dir, max_entries=cfg.cache_max_entries,
                                    max_mb=cfg.cache_max_mb, salt=salt)
            self.runner = Runner(self.device, cache, executor=executor)

    @_locked
    def set_adaptive(self, on: bool) -> None:
        if on != self.adaptive:
            self.flush("mode switch")
            self.traces.forget()
        self.adaptive = bool(on)

    @_locked
    def set_strategy(self, name: str) -> None:
        if name not in STRATEGIES:
            raise ValueError(f"unknown fusion strategy {name!r}; choose one of "
                             f"{sorted(STRATEGIES)}")
        self.flush("strategy switch")
        self.strategy_name = name
        self.reconfigure()

    def is_lazy(self) -> bool:
        # The reference disables adaptive eager under deterministic algorithms; under
        # NEURON_LAUNCH_BLOCKING=1 every op runs (and raises) at its call, so nothing queues.
        return (self.adaptive and not self.device.blocking
                and not _deterministic())

    # -- tensors ---------------------------------------------------------------------
    def wrap(self, handle: Handle, size, stride, offset, dtype) -> torch.Tensor:
        return NeuronTensor(self, handle, size, stride, offset, dtype)

    @_locked
    def empty(self, size, stride, dtype) -> torch.Tensor:
        """A fresh allocation (`torch.empty` and friends): HBM reserved now."""
        dtype = dtype or torch.get_default_dtype()
        self.check_dtype(dtype)
        nbytes = extent_bytes(size, stride, 0, dtype.itemsize)
        self.make_room(nbytes)
        h = Handle(nbytes, self.device.alloc(nbytes))
        if self.index:  # every tensor of a core starts from an allocation there
            _OTHER_CORES_USED[0] = True
        return self.wrap(h, size, stride, 0, dtype)

    def make_room(self, nbytes: int) -> None:
        """Room in HBM for `nbytes` more (besides what queued ops will make): what is queued
        is launched if that frees enough, else the out-of-memory error, naming sizes."""
        hbm, seg = self.device.hbm, self.seg
        hbm.check_host(nbytes)
        if hbm.used + seg.pending_bytes + nbytes > hbm.capacity and seg.nodes:
            self.flush("memory")
        if hbm.used + seg.pending_bytes + nbytes > hbm.capacity:
            hbm.reserve(nbytes + seg.pending_bytes)  # raises the OOM error, naming sizes

    def count_op(self) -> None:
        """Every op is counted once, with its host overhead on the simulated clock."""
        self.metrics.ops += 1
        self.device.advance_host(self.spec.host_op_overhead_us)

    def check_dtype_f64(self) -> None:
        self.check_dtype(torch.float64)

    def check_dtype(self, dtype) -> None:
        if dtype == torch.float64 and "f64" not in self.warned:
            self.warned.add("f64")
            warnings.warn("float64 is not supported on Neuron: it is computed as float32 "
                          "(results may differ from CPU). Use float32 to silence this; where "
                          "PyTorch's own code makes float64 (GradScaler's unscale_), filter "
                          "it: warnings.filterwarnings('ignore', 'float64 is not supported')",
                          stacklevel=_user_stacklevel())

    # -- dispatch --------------------------------------------------------------------
    def dispatch(self, func, args, kwargs):
        USERS.add(_get_ident())  # Note [Threads] at exit
        lock = self.lock
        try:
            lock.acquire()  # (`with`, unrolled: this runs per op)
            try:
                if kwargs and kwargs.get("generator") is not None:
                    return self._with_generator(func, args, kwargs)
                route = _ROUTES.get(func._op) or _route(func)
                if route.view:  # Note [Replayed views]: never in a trace
                    if route.special is not None:  # (_unsafe_view: as view)
                        return route.special(self, func, args, kwargs)
                    return self.dispatch_plain(func, args, kwargs, route)
                tr = self.traces
                if tr.expect is not None:  # Note [Replay]: the steady state's path
                    out = replay.follow(self, func, args, kwargs)
                    if out is not MISS:
                        if out is not MISSED:
                            return out
                        return self.dispatch_plain(func, args, kwargs, counted=True)
                if tr.expect is None and not tr.nodes:  # the op may begin a trace (every
                    out = replay.step(self, func, args, kwargs)  # op in eager mode)
                    if out is not MISS:
                        if out is not MISSED:
                            return out
                        return self.dispatch_plain(func, args, kwargs, counted=True)
                if route.special is not None:
                    return route.special(self, func, args, kwargs)
                if route.composite is not None:  # Note [Composite ops in inference mode]
                    return _composite(func, route.composite, args, kwargs)
                return self.dispatch_plain(func, args, kwargs, route)
            finally:
                lock.release()
        except BaseException as e:
            # Note [Device-thread errors] in hooks.py: inside a backward node (autograd's
            # device thread, or the caller's own thread once backward runs single-threaded,
            # Note [Cores]) an exception must not unwind through PyTorch's device guard.
            if in_backward():
                return _hand_off(e)
            if errors.is_user_error(e):  # CPU's own error: no frames of ours
                raise e.with_traceback(None) from None
            raise

    def _with_generator(self, func, args, kwargs):
        """A random op given a generator (Note [Native hooks] in integration/native.py): its draws are
        taken now, in order, from the generator's CPU generator (a device launch the host
        waits for), so seeding or reading that generator afterwards sees them taken. A
        generator of another device is refused with CUDA's error."""
        gen = kwargs["generator"]
        if gen.device.type != DEVICE_TYPE:
            raise _generator_error(gen)
        self.metrics.ops += 1
        self.device.advance_host(self.spec.host_op_overhead_us)
        return run_now(self, func, args, kwargs, fallback=False)

    def dispatch_plain(self, func, args, kwargs, route=None, counted=False):
        """An op as the engine runs every op it does not handle specially (`_SPECIAL`): the
        handlers end here. `route`: Engine.dispatch's plain route; `counted`: the op was
        counted on the way (`replay.follow`)."""
        if not counted:
            self.count_op()
        if route is None:
            route = _ROUTES.get(func._op) or _route(func)
        cls = route.cls
        if cls is None:
            return run_now(self, func, args, kwargs, fallback=True)
        if cls == BARRIER:
            return run_now(self, func, args, kwargs, fallback=False)
        if cls == INPLACE_VIEW:
            return results.inplace_view(self, func, args, kwargs)
        if (func._op is _SELECT or func._op is _SLICE) and not kwargs:  # `a[i]`, `a[i:j]`:
            out = results.view_at(self, func, args, route, _view_key)  # Note [View inference]
            if out is not None:
                return out
        vkey = cls == VIEW and not kwargs and _view_key(self, func, args)
        if vkey:  # Note [View keys]
            meta = self.meta_cache.get(vkey)
            if meta is not None:  # (made under this global state: it is in the key)
                return results.results(self, func, args, kwargs, [args[0]._handle], meta, ())
        args_t, kwargs_t, handles, inputs, vbytes = template(self, func, args, kwargs,
                                                             route.scalars)
        key = (func._op, args_t, kwargs_t, _global_state())  # (OpOverload hashes in Python)
        meta = self.meta_cache.get(key)
        if meta is None:
            meta = cls == VIEW and infer_view(func, args, kwargs, args_t, kwargs_t,
                                              handles) or infer(func, args, kwargs, args_t,
                                                                kwargs_t, handles)
            if meta is not _RUN_NOW:
                meta.gstate = key[3]
                if route.special is not None and func._op not in replay.GUARDS \
                        or route.composite is not None:
                    # Engine.dispatch must not replay it past a handler of ours (Note [Replay],
                    # Note [Guarded replay])
                    meta.replay = False
            if len(self.meta_cache) >= 100_000:  # bound memory under ever-new shapes
                self.meta_cache.clear()
            self.meta_cache[key] = meta
            if vkey and meta is not _RUN_NOW and meta.op is None and not inputs \
                    and len(handles) == 1 and not (meta.checks or meta.warns or meta.resize):
                self.meta_cache[vkey] = meta
        if meta is _RUN_NOW:
            # Shape inference cannot say what the op returns (a boolean mask's nonzero inside
            # index, repeat_interleave without output_size, a meta kernel that refuses what
            # CPU accepts): the op runs now on the device and the host waits for its shapes.
            return run_now(self, func, args, kwargs, fallback=False)
        if cls == KERNEL and meta.op is not None:  # Note [Custom kernels]
            _check_sbuf(self, func, meta.op.cost)
        if meta.checks:  # Note [Scalar conversion] in meta.py
            check_conversions(meta.checks, inputs)
        if meta.warns:
            give_warnings(meta.warns)
        if meta.resize:  # out= of the wrong shape: resized as CPU does, then the op again
            self.metrics.ops -= 1
            results.resize_outs(self, func, args, kwargs, meta.resize)
            return self.dispatch_plain(func, args, kwargs)
        new = () if meta.op is None else record(self, meta, handles, inputs, vbytes)
        return results.results(self, func, args, kwargs, handles, meta, new)

    # -- flush and sync --------------------------------------------------------------
    @_locked
    def flush(self, reason: str) -> None:
        if not self.seg.nodes:
            return
        nodes, refs = self.seg.take()
        lazy = self.is_lazy()
        report = self.launch(nodes, refs, reason, self.strategy if lazy else self.eager_strategy,
                             substitute=lazy and _config.config.substitute)
        trace = self.traces.remember(reason, lazy, self.strategy.key)
        sig = report[10]
        if trace is not None and not lazy and trace.n == 1 and all(sig[3]):
            trace.sig = sig  # Note [Eager launches] in replay.py
        if self.device.blocking:  # the host waits (errors raise here)
            self.synchronize()

    def launch(self, nodes, refs, reason, strategy, sig=None, substitute=False, trace=None):
        """Run flushed `nodes` (Runner.flush; `sig`: their plan key, with `refs` the handles;
        `substitute`: Note [Substitution]) and count the flush (its metrics). Returns its
        report's fields (`last_report` makes the report when read). With `trace`: Note [Eager
        launches] in replay.py: eager op `nodes[0]`, replayed from one-op `trace` with its
        buffers `refs` (numbered as a segment of its own would number them), is run as
        `flush("eager")` would run that segment, without queuing it."""
        runner = self.runner
        runner.done = 0  # what _interrupted reads if the flush stops before it starts
        args = (runner.flush, nodes, refs, reason, strategy, substitute) if sig is None \
            else (runner.run_sig, nodes, refs, sig, reason, strategy)
        try:  # Note [Host calls] in fusion/host.py; Note [CPU settings] for flush-to-zero
            if cpu_settings.FTZ_USED[0] or cpu_settings.THREADS_SET[0] \
                    or torch.is_inference_mode_enabled():
                with cpu_settings.ftz(self.seg.ftz), cpu_settings.threads(self.seg.threads), \
                        _ordinary_tensors():
                    report = _host.host_call(*args)
            else:
                report = _host.host_call(*args)
        except BaseException as e:
            _interrupted(self, nodes, refs, e)
            self.traces.forget()
            raise
        self._report = report
        m = self.metrics
        m.flushes[reason] += 1
        sizes = m.group_sizes
        for k, v in report[3].size_items:
            sizes[k] += v
        if trace is not None:
            self.traces.again(trace)
            if self.device.blocking:  # the host waits (errors raise here)
                self.synchronize()
        return report

    @property
    def last_report(self) -> FlushReport | None:
        """The last flush's report (`ae.explain`), made from its fields when first read."""
        r = self._report
        if type(r) is tuple:
            r = self._report = FlushReport(*r)
        return r

    @_locked
    def with_rng(self, fn):
        """`fn(rng)` on the device RNG once the queued random ops have drawn from it (they keep
        the state they were issued under), with no other thread's random op between: how
        seeding, reading and setting its state touch it."""
        self.flush("rng")
        return fn(self.device.rng)

    @_locked
    def synchronize(self) -> None:
        """Wait for the device; raise the earliest deferred error (op and source line)."""
        try:
            self.device.synchronize()
        except DeviceError as e:
            _raise_launch_error(e.launch)

    @_locked
    def sync(self, reason: str) -> None:
        self.flush(reason)
        t0 = self.device.host_us
        self.synchronize()
        self.device.mark(reason, "sync", self.device.host_us - t0, t0)
        for hook in AT_SYNC:
            hook()

    # -- host transfers and ops that need data now (transfer.py, fallback.py) ----------
    @_locked
    def read(self, t, reason: str, dma: str = "d2h") -> torch.Tensor:
        """Device-to-host: the current value of neuron tensor `t` as a CPU tensor."""
        return transfer.read(self, t, reason, dma)

    @_locked
    def write(self, dst, src: torch.Tensor, dma: str = "h2d") -> None:
        """Host-to-device copy into neuron tensor `dst` (broadcast and casts as copy_)."""
        transfer.write(self, dst, src, dma)

    def peer(self, index: int | None) -> "Engine":
        """The engine of core `index` (None: the current core), if this process sees it."""
        return current() if index is None else core(check_core(index))

    @_locked
    def run_now(self, func, args, kwargs, fallback: bool):
        return run_now(self, func, args, kwargs, fallback)


def _check_sbuf(eng, func, cost) -> None:
    """A kernel whose declared working set is larger than the core's SBUF cannot be built
    (as NKI's compiler refuses it): refused at the call, naming both figures."""
    if cost.sbuf_bytes > eng.spec.sbuf_bytes:
        raise errors.user_error(RuntimeError(
            f"kernel {func._schema.name} declares {cost.sbuf_bytes} bytes of SBUF for these "
            f"inputs, but a NeuronCore has {eng.spec.sbuf_bytes} (DeviceSpec.sbuf_bytes): "
            f"tile its work in smaller blocks"))


@functools.lru_cache(maxsize=None)
def _package_version() -> str:
    """Read once per process: every reconfigure salts the disk cache with it, and re-reading
    the installed metadata while pip rewrote it (a reinstall beside a running program) gave
    None, a TypeError inside `ae.adaptive(strategy=...)` (fuzzer seed 32000018)."""
    try:
        return importlib.metadata.version("adaptive-eager") or "0+unknown"
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "0+unknown"


# -- ops the engine handles itself -----------------------------------------------------
def _materialized(op):
    """Conjugate and negative views carry a bit our wrapper tensors cannot honour: computed
    as a new tensor instead (`z.conj()` equals CPU's values; `is_conj()` is False)."""
    def run(eng, func, args, kwargs):
        # Note [Copied views] in errors.py
        return errors.copied_view(eng.dispatch_plain(op, args, kwargs))
    return run


def _unsafe_view(eng, func, args, kwargs):
    return eng.dispatch(aten.view.default, args, kwargs)


def _set_(eng, func, args, kwargs):
    """`t.set_(other)`, `t.set_(other, offset, size, stride)`, `t.set_()`: t becomes a view
    of other's buffer (Note [set_] in storage.py)."""
    from .storage import set_storage
    t, rest = args[0], list(args[1:])
    source = rest.pop(0) if rest else kwargs.get("source")
    if not isinstance(t, NeuronTensor):  # a host tensor set to a neuron one
        raise RuntimeError(
            f"Attempted to set the storage of a tensor on device \"{t.device}\" to a storage "
            f"on different device \"{source.device}\".  This is no longer allowed; the "
            f"devices must match.")
    if source is None:
        return set_storage(t, None, 0, (0,), (1,))
    if not isinstance(source, NeuronTensor):  # a host tensor or storage: CPU's device error
        return set_storage(t, source.untyped_storage() if isinstance(source, torch.Tensor)
                           else source, 0)
    if source.dtype != t.dtype:
        raise RuntimeError(f"Could not set tensor of type {source.dtype} to a tensor of "
                           f"type {t.dtype}")
    names = ("storage_offset", "size", "stride")
    given = dict(zip(names, rest), **{k: v for k, v in kwargs.items() if k in names})
    return set_storage(t, source.untyped_storage(),
                       given.get("storage_offset", source.storage_offset()),
                       given.get("size", source.shape), given.get("stride", source.stride()))


def _block_diag(eng, func, args, kwargs):
    """block_diag checks its inputs' devices itself, before anything else, in its own words
    (PyTorch's tests match them); then it is an ordinary op."""
    tensors = args[0] if args else kwargs["tensors"]
    first = tensors[0].device if tensors else None
    for i, t in enumerate(tensors):
        if t.device != first:
            e = RuntimeError(f"torch.block_diag: input tensors must all be on the same device. "
                             f"Input 0 is on device {first} and input {i} is on device "
                             f"{t.device}")
            e._ae_user_error = True
            raise e
    return eng.dispatch_plain(func, args, kwargs)


def _bumps_versions(eng, func, args, kwargs):
    """In-place foreach ops have no ADInplaceOrView kernel to bump the version of what they
    write: CUDA's kernels bump it themselves (CPU's per-tensor fallback gets it from each op),
    and so does neuron. Without it autograd misses the write: a view of a written tensor keeps
    a stale grad_fn (its backward dropped the gradient), and a tensor saved for backward can
    be overwritten (optimizer.step() before backward()) with no error."""
    written = [args[0]] if isinstance(args[0], torch.Tensor) else list(args[0])
    if not torch.is_inference_mode_enabled() and any(t.is_inference() for t in written):
        raise RuntimeError(_INFERENCE_WRITE)  # CPU's words (its per-tensor fallback checks)
    out = replay.handled_step(eng, func, args, kwargs)  # Note [Handled replay]
    torch.autograd.graph.increment_version(written)
    return out


def _bumps_fused_versions(eng, func, args, kwargs):
    """torch.optim's fused steps (`fused=True`) write parameters, gradients and state in
    place, with no ADInplaceOrView kernel either: the versions of what they write are bumped,
    as the foreach steps' are (`_bumps_versions`), so a backward through a graph that saved a
    parameter before `step()` raises instead of using the new values. (CPU's fused kernels
    bump none, a silently wrong gradient there; foreach=True, CPU's default, raises.)"""
    written = [t for t in written_values(func, args, kwargs) if isinstance(t, torch.Tensor)]
    if not torch.is_inference_mode_enabled() and any(t.is_inference() for t in written):
        raise RuntimeError(_INFERENCE_WRITE)
    out = replay.handled_step(eng, func, args, kwargs)  # Note [Handled replay]
    torch.autograd.graph.increment_version(written)
    return out


def _lift_fresh(eng, func, args, kwargs):
    """`torch.tensor(data, device="neuron")` makes a device tensor, then lifts it. While
    torch.compile traces (a FakeTensorMode is active) the modes decline a tensor subclass
    and hand the lift to us. It is then done as PyTorch does where no device is present
    (NOTE [torch.tensor, lift_fresh, and device movement] in fake_tensor.py): the value is
    lifted on the host, where the modes make it a graph constant, and copied into a new
    device tensor (a traced `empty` and `copy_`: FakeTensorMode would propagate a constant
    through `.to`, making a real device tensor its constant). So the graph holds a CPU
    constant and an H2D copy, never a fake tensor."""
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None:
        return eng.dispatch_plain(func, args, kwargs)
    from torch.utils._python_dispatch import _disable_current_modes
    t = args[0]
    with _disable_current_modes():  # the real value, read with no mode watching
        host = eng.read(t, "compile constant")
    lifted = func(host)  # through the modes from here on: traced
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(lifted)


def _host_indices(eng, func, args, kwargs):
    """`x[i]` and `x[i] = v` with a CPU index tensor `i` (index, index_put_ and their kin):
    CUDA's kernels accept host indices and copy them to the device; so does neuron."""
    def to_device(t):
        if type(t) is NeuronTensor or not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return t
        return transfer.upload(eng, t)
    if "indices" in kwargs:
        kwargs = {**kwargs, "indices": [to_device(t) for t in kwargs["indices"]]}
    else:
        args = (args[0], [to_device(t) for t in args[1]]) + tuple(args[2:])
    return eng.dispatch_plain(func, args, kwargs)


def _attention_fast_path(eng, func, args, kwargs):
    """nn.MultiheadAttention's inference fast path runs on the device, but with
    need_weights=False CPU's kernel returns no weights (None) where the meta kernel makes an
    empty tensor: that call stays a CPU fallback, which returns CPU's None."""
    need_weights = argument(func, args, kwargs, "need_weights", True)  # (the schema's default)
    if need_weights:
        return eng.dispatch_plain(func, args, kwargs)
    return eng.run_now(func, args, kwargs, True)


def _checks_errors(eng, func, args, kwargs):
    """An `_ex` factorization asked to check its errors (`inv_ex(A, check_errors=True)`) raises
    in its kernel on a singular matrix: it runs at once, so CPU's error raises at the call
    (Note [Linear algebra on the device] in fusion/ops.py); without the check it is queued."""
    if not kwargs.get("check_errors"):  # (keyword-only in every schema)
        return eng.dispatch_plain(func, args, kwargs)
    eng.count_op()
    return eng.run_now(func, args, kwargs, False)


def _is_pinned(eng, func, args, kwargs):
    return False  # device memory is never pinned host memory (CUDA's answer; no sync)


# Questions about metadata are answered from it, as CPU's kernels answer them (a CPU fallback
# would copy both tensors out, warn, and compare the copies); forward AD (torch.func.jvp,
# jacfwd) asks the first two of every tangent.
def _is_same_size(eng, func, args, kwargs):
    return args[0].shape == args[1].shape


def _has_same_storage_numel(eng, func, args, kwargs):
    a, b = args
    return a.untyped_storage().nbytes() // a.element_size() \
        == b.untyped_storage().nbytes() // b.element_size()


def _is_set_to(eng, func, args, kwargs):
    a, b = args
    return type(b) is NeuronTensor and a._handle is b._handle \
        and a.storage_offset() == b.storage_offset() and a.shape == b.shape \
        and a.stride() == b.stride()


def _strided_dims(eng, func, args, kwargs):
    """`sparse_dim()` / `dense_dim()` of a strided tensor: metadata, CPU's answer (0 and
    `dim()`), with no CPU fallback (the device holds strided tensors only)."""
    return 0 if func is aten.sparse_dim.default else args[0].dim()


def _pin_memory(eng, func, args, kwargs):
    raise RuntimeError(f"cannot pin '{args[0].type()}' only dense CPU tensors can be pinned")


_SPECIAL = {
    aten.is_pinned.default: _is_pinned,
    aten._pin_memory.default: _pin_memory,
    aten.is_same_size.default: _is_same_size,
    aten._has_same_storage_numel.default: _has_same_storage_numel,
    aten.is_set_to.default: _is_set_to,
    aten.sparse_dim.default: _strided_dims,
    aten.dense_dim.default: _strided_dims,
    aten.index.Tensor: _host_indices,
    aten._unsafe_index.Tensor: _host_indices,
    aten.index_put_.default: _host_indices,
    aten.index_put.default: _host_indices,
    aten._index_put_impl_.default: _host_indices,
    aten._unsafe_index_put.default: _host_indices,
    aten._native_multi_head_attention.default: _attention_fast_path,
    aten.lift_fresh.default: _lift_fresh,
    aten.lift_fresh_copy.default: _lift_fresh,
    aten.copy_.default: transfer.copy_,
    aten.copy.default: transfer.copy,
    aten._to_copy.default: transfer.to_copy,
    aten._local_scalar_dense.default: transfer.local_scalar_dense,
    aten._unsafe_view.default: _unsafe_view,
    aten._conj.default: _materialized(aten.conj_physical.default),
    aten._neg_view.default: _materialized(aten.neg.default),
}
replay.GUARDS[aten.copy_.default._op] = transfer.queues_copy  # Note [Guarded replay]
for _op in transfer.LIKE:
    _SPECIAL[_op] = transfer.like
    replay.GUARDS[_op._op] = transfer.queues_like  # (autograd's ones_like: a step's grad seed)
_SPECIAL[aten.block_diag.default] = _block_diag
for _packet in (aten.linalg_inv_ex, aten._linalg_solve_ex, aten.linalg_cholesky_ex,
                aten.linalg_lu_factor_ex, aten.linalg_ldl_factor_ex):
    for _op in _packet.overloads():
        _SPECIAL[getattr(_packet, _op)] = _checks_errors
for _op in aten.set_.overloads():
    _SPECIAL[getattr(aten.set_, _op)] = _set_
for _name in {n.split(".")[0] for n in torch._C._dispatch_get_all_op_names()}:
    if _name.startswith("aten::_foreach_") and _name.endswith("_"):  # writes its first list
        _packet = getattr(aten, _name[6:])
        for _op in _packet.overloads():
            _op = getattr(_packet, _op)
            assert _op._schema.arguments[0].alias_info.is_write, _op
            _SPECIAL[_op] = _bumps_versions
for _name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"):
    for _op in getattr(aten, _name).overloads():
        _SPECIAL[getattr(getattr(aten, _name), _op)] = _bumps_fused_versions
# (by the C++ op: an OpOverload hashes in Python, and writes_foreach runs per op)
_FOREACH_WRITES = frozenset(f._op for f, h in _SPECIAL.items() if h is _bumps_versions)


def writes_foreach(func) -> bool:
    """Is `func` an in-place foreach op (writes the tensors of its first list)?"""
    return func._op in _FOREACH_WRITES


class _Route(NamedTuple):
    """How `Engine.dispatch` routes one op, looked up once per op overload."""

    special: Callable | None  # the engine's own handler (`_SPECIAL`)
    composite: object  # Note [Composite ops in inference mode]: the kernel's key, or None
    cls: str | None  # fusion.ops.op_class
    scalars: tuple  # fusion.ir.scalar_positions
    view: bool  # Note [Replayed views]: a view op, no composite kernel, no handler but as view


_SELECT, _SLICE = aten.select.int._op, aten.slice.Tensor._op


# keyed by `func._op`, the C++ operator behind an OpOverload: an OpOverload hashes through a
# Python __hash__, and this lookup runs per op
_ROUTES: dict = {}


# Note [View keys]: a view op's template (Note [Templates] in fusion/ir.py) is its tensor's
# layout and its other arguments' static encodings, so a call whose only tensor is its first
# argument, on this core and within its buffer, and whose other arguments are ints or lists
# or tuples of ints, is keyed by (op, that layout, those values with their types): the meta
# cache keeps the meta result under that key too (for views that check, warn and resize
# nothing and queue no op), with the global state it was made under in the key, as the
# template way's key has it: a layout viewed under two states (a weight's `t()` in forward
# and, grad mode off, in backward) has an entry per state, not one that the other state
# misses (44 of a GPT step's views took the templates so, every step). A view then skips the
# templates (about 40% of its host time: a GPT step makes ~230 views). Anything else goes
# the template way, which raises the errors (another core, a freed storage).
# Note [Replayed views]: a view op (no composite kernel, no handler of ours but
# `_unsafe_view`'s, which is `view`: `_Route.view`) bypasses the replay (Note [Replay] in
# replay.py) and goes straight to its view key, or the template way. It queues nothing, so
# no trace holds it: `follow` could only find that it is not the expected op (each of a
# GPT step's ~230 views paid that check, then the route), and `step` that no trace begins
# with it. The replay stays on across it, as before. A view op that does queue an op (the
# template way inferred one) takes the slow path, and the replay resumes after its node
# when it is the trace's (`resumes`).
def _view_key(eng, func, args):
    """Note [View keys]: the key of view call `func(*args)`, or None."""
    a = args[0] if args else None
    if type(a) is not NeuronTensor or a._engine is not eng or a._info[2] > a._handle.nbytes:
        return None
    rest = []
    for v in args[1:]:
        t = type(v)
        if t is int:
            rest.append(v)
        elif (t is list or t is tuple) and all(type(x) is int for x in v):
            rest.append((t, tuple(v)))
        else:
            return None
    return ("view", func._op, a._info[0], tuple(rest), _global_state())


def _route(func) -> _Route:
    special, composite, cls = _SPECIAL.get(func), composite_key(func), op_class(func)
    r = _Route(special, composite, cls, scalar_positions(func),
               cls == VIEW and special in (None, _unsafe_view) and composite is None)
    if r.cls is not None or func.namespace == "aten":  # (a custom op's neuron kernel may be
        _ROUTES[func._op] = r  # registered after its first call: Note [Custom kernels])
    return r


ENGINE = Engine()  # neuron:0
_OVERRIDES = Scopes(_read_setting, lambda values: _apply_settings(values))
ENGINES = [ENGINE]  # by core index (visible numbering); the others are made on first use
_CURRENT = [0]  # the current core's index (torch.neuron.set_device checks it first)
_OTHER_CORES_USED = [False]  # a tensor was ever allocated on a core other than neuron:0


def _interrupted(eng, nodes, refs, e: BaseException) -> None:
    """A flush raised (Ctrl-C lands in the Python that runs the device's work): the values
    it had not computed yet stay unreadable with an error saying so, instead of handles
    with no buffer (AttributeError on a later read, and on any op reading them). So do the
    buffers its unrun ops update in place (an optimizer step's parameters): on CPU every
    update that returned was applied, and here some were not, or only partly; reading them
    raises instead of giving the old value. Values computed before the interrupt stay."""
    why = f"{type(e).__name__} interrupted the flush that"
    new = errors.FlushInterrupted(f"{why} computes this value, so it was never computed: compute it "
                           f"again")
    updated = errors.FlushInterrupted(f"{why} updates this tensor in place, so the update was not "
                               f"applied, or only partly: restore its value (from a "
                               f"checkpoint) or compute it again")
    done = eng.runner.done if eng.runner is not None else 0
    for i, n in enumerate(nodes):
        launches = {}  # the op (and source line) that would have made or updated the value
        for li, ci in enumerate(n.uids):
            r = refs[ci]
            h = r() if type(r) is weakref.ref else r
            if h is None or not (h.pending or (i >= done and li in n.writes)):
                continue
            kind = "new" if h.pending else "updated"
            if kind not in launches:
                launches[kind] = Launch(n.name, None, 0, 0.0, context=[n])
                launches[kind].error = new if h.pending else updated
            if h.pending:
                h.buffer = eng.device.alloc(h.nbytes, torch.UntypedStorage(h.nbytes))
                h.pending = False
            h.poison = h.poison or launches[kind]


def _after_fork_in_child() -> None:
    """Note [Threads] across os.fork: only the forking thread lives on in the child, and a
    lock another thread held at the fork stays held for good (a DataLoader worker, forked
    while a thread ran neuron ops, hung in torch.manual_seed). The child gets fresh locks,
    and counters of its own (its metrics file counts its own work, not the parent's again).
    What the parent's other threads were doing at the fork is lost, as in any library."""
    global _LOCK
    _LOCK = threading.RLock()
    for eng in ENGINES:
        eng.lock = _LOCK
        eng.device.hbm.after_fork()
    hooks.after_fork()
    COUNTERS.reset()


os.register_at_fork(after_in_child=_after_fork_in_child)


def other_cores_used() -> bool:
    """Whether a core other than neuron:0 ever held a tensor (Note [Cores]: backward then
    runs on one thread)."""
    return _OTHER_CORES_USED[0]


def visible_cores() -> int:
    """How many NeuronCores this process sees (the chip's, or NEURON_RT_* restrictions)."""
    cfg, chip = _config.config, ENGINE.spec.chip_cores
    if cfg.visible_cores is not None:
        bad = [c for c in cfg.visible_cores if not 0 <= c < chip]
        if bad or not cfg.visible_cores:
            raise RuntimeError(f"NEURON_RT_VISIBLE_CORES={cfg.visible_cores} names cores "
                               f"the chip does not have: it has {chip} (0..{chip - 1})")
        twice = sorted({c for c in cfg.visible_cores if cfg.visible_cores.count(c) > 1})
        if twice:
            raise RuntimeError(f"NEURON_RT_VISIBLE_CORES={cfg.visible_cores} names core"
                               f"{'s' if len(twice) > 1 else ''} {twice} more than once: "
                               f"name each core once")
        return len(cfg.visible_cores)
    if cfg.num_cores is not None:
        if not 0 < cfg.num_cores <= chip:
            raise RuntimeError(f"NEURON_RT_NUM_CORES={cfg.num_cores} but the chip has "
                               f"{chip} NeuronCores")
        return cfg.num_cores
    return chip


def check_core(index: int) -> int:
    """`index`, if this process sees neuron:`index`; else CUDA's kind of error."""
    n = visible_cores()
    if not 0 <= index < n:
        raise RuntimeError(f"neuron:{index} does not exist: this process sees {n} NeuronCore"
                           f"{'s' if n != 1 else ''} (neuron:0..{n - 1}; see "
                           f"NEURON_RT_VISIBLE_CORES / NEURON_RT_NUM_CORES)")
    return index


def flush_all(reason: str) -> None:
    """Flush every core's queue (a CPU setting is about to change: Note [CPU settings])."""
    with _LOCK:
        for eng in list(ENGINES):
            eng.flush(reason)


# Note [Native hooks] in integration/native.py: with them, the current core is the C++ device guard's,
# per thread as CUDA's (PyTorch resolves an index-less "neuron" through it); without them it
# is `_CURRENT`, per process. NATIVE: the hooks' (get, set), once registration loads them.
NATIVE = None


def use_native_current(get, set_) -> None:
    """The current core is the native hooks' from now on (registration calls this)."""
    global NATIVE
    NATIVE = (get, set_)


def current_index() -> int:
    return _CURRENT[0] if NATIVE is None else NATIVE[0]()


def current() -> Engine:
    """The current core's engine: where "neuron" with no index goes."""
    return core(current_index())


def set_current(index: int) -> None:
    if NATIVE is None:
        _CURRENT[0] = index
    else:
        NATIVE[1](index)


def core(index: int) -> Engine:
    """The engine of neuron:`index`, made on first use with core 0's spec, mode and strategy
    (the caller checks that this process sees that core: neuron._check)."""
    with _LOCK:
        while len(ENGINES) <= index:
            e = Engine(len(ENGINES), ENGINE.spec)
            e.device.rng.manual_seed(ENGINE.device.rng.seed)  # torch.manual_seed's seed
            e.adaptive, e.strategy_name = ENGINE.adaptive, ENGINE.strategy_name
            e.reconfigure()
            ENGINES.append(e)
    return ENGINES[index]
