"""The engine: every ATen op on a neuron tensor lands in `Engine.dispatch`.

Three steps per op (as jax's dispatch): abstract specs (meta execution, cached per
signature, so shape/dtype errors raise at the call), a queued node, and a flush that turns
queued nodes into launches. In eager mode every op flushes at once; in adaptive mode the
queue is flushed at sync points, boundaries, a full buffer, or when the device runs idle.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import threading
import warnings
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from device import COUNTERS, Device, DeviceError, DeviceSpec, Launch, LaunchError
from fusion.cache import ExecutableCache
from fusion.executors import make_executor
from fusion.flush import Runner
from fusion.ir import Handle, Node, encode_static, scalar_positions
from fusion.ops import BARRIER, INPLACE_VIEW, op_class
from fusion.partition import STRATEGIES, OnlineGroup

from . import config as _config
from .errors import (NeuronFallbackError, _generator_error, _hand_off, _out_of_bounds,
                     _raise_launch_error, _sparse_error)
from .meta import _RUN_NOW, _extent_bytes, _global_state, _meta_buffers, _to_meta, infer
from .source import _source, _user_stacklevel

aten = torch.ops.aten
DEVICE = None  # torch.device("neuron", 0), set by registration
NeuronTensor = None  # the tensor class, set by _tensor (which imports this module)


@contextlib.contextmanager
def override(**changes):
    """Temporarily change settings (`with ae.override(queue_low_threshold=0): ...`); the
    engine flushes, applies them, and restores the old values on exit. `adaptive` and
    `strategy` set the engine's mode and strategy for the block."""
    cfg = _config.config
    for k in changes:
        if not hasattr(cfg, k):
            raise AttributeError(f"no setting named {k!r}; `python -m adaptive_eager config` lists them")
    if "strategy" in changes and changes["strategy"] not in STRATEGIES:
        raise ValueError(f"unknown fusion strategy {changes['strategy']!r}; choose one of "
                         f"{sorted(STRATEGIES)}")
    old = {k: getattr(cfg, k) for k in changes}
    state = (ENGINE.adaptive, ENGINE.strategy_name)

    def restore():
        _apply_settings(old)
        with ENGINE.lock:
            ENGINE.adaptive, ENGINE.strategy_name = state
            ENGINE.reconfigure()

    try:
        _apply_settings(changes)
    except BaseException:  # a refused value (an unknown executor...): the old settings stay
        restore()
        raise
    try:
        yield cfg
    finally:
        restore()


def _apply_settings(values: dict) -> None:
    eng = ENGINE
    with eng.lock:
        eng.flush("config")
        for k, v in values.items():
            setattr(_config.config, k, v)
        if "adaptive" in values:
            eng.adaptive = bool(values["adaptive"])
        if "strategy" in values:
            eng.strategy_name = values["strategy"]
        eng.reconfigure()


def _locked(method):
    """Run an engine entry point under the engine lock (Note [Threads])."""
    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    locked.__name__, locked.__doc__ = method.__name__, method.__doc__
    return locked


class Engine:
    def __init__(self):
        self.metrics = COUNTERS  # the one counters object (device/counters.py)
        self.queue: list[Node] = []
        self.online = OnlineGroup()
        self.pending_bytes = 0
        self.meta_cache: dict = {}
        self.last_report = None
        # Note [Threads]: one engine lock. Every entry point (an op, a host read or write,
        # an allocation, a sync, a settings change) holds it, so the ops of several threads
        # run in some serial order of each thread's ops, sharing one queue, cache and
        # device; results are bit for bit those of that order. Re-entrant: an op may
        # allocate, flush and sync inside. Autograd's device thread takes it per op too.
        self.lock = threading.RLock()
        self._warned: set[str] = set()
        self.spec = DeviceSpec()
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
        if spec is not None and spec != self.spec:
            self.flush("config")
            self.synchronize()
            self.spec = spec
            rng = self.device.rng
            self.device = Device(spec)
            self.device.rng = rng
        self.device.blocking = cfg.launch_blocking
        self.device.realtime = cfg.realtime
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
                and not torch.are_deterministic_algorithms_enabled())

    # -- tensors ---------------------------------------------------------------------
    def wrap(self, handle: Handle, size, stride, offset, dtype) -> torch.Tensor:
        return NeuronTensor(handle, size, stride, offset, dtype)

    @_locked
    def empty(self, size, stride, dtype) -> torch.Tensor:
        """A fresh allocation (`torch.empty` and friends): HBM reserved now."""
        dtype = dtype or torch.get_default_dtype()
        self._check_dtype(dtype)
        nbytes = _extent_bytes(size, stride, 0, dtype.itemsize)
        self._make_room(nbytes)
        h = Handle(nbytes, self.device.alloc(nbytes))
        return self.wrap(h, size, stride, 0, dtype)

    def _make_room(self, nbytes: int) -> None:
        hbm = self.device.hbm
        if hbm.used + self.pending_bytes + nbytes > hbm.capacity and self.queue:
            self.flush("memory")
        if hbm.used + self.pending_bytes + nbytes > hbm.capacity:
            hbm.reserve(nbytes + self.pending_bytes)  # raises the OOM error, naming sizes

    def _check_dtype(self, dtype) -> None:
        if dtype == torch.float64 and "f64" not in self._warned:
            self._warned.add("f64")
            warnings.warn("float64 is not supported on Neuron: it is computed as float32 "
                          "(results may differ from CPU). Use float32 to silence this.",
                          stacklevel=_user_stacklevel())

    # -- dispatch --------------------------------------------------------------------
    def dispatch(self, func, args, kwargs):
        try:
            with self.lock:
                special = _SPECIAL.get(func)
                if special is not None:
                    return special(self, func, args, kwargs)
                return self._dispatch(func, args, kwargs)
        except BaseException as e:
            if type(threading.current_thread()) is threading._DummyThread:
                return _hand_off(e)  # Note [Device-thread errors] in errors.py
            if getattr(e, "_ae_user_error", False):  # CPU's own error: no frames of ours
                raise e.with_traceback(None) from None
            raise

    def _dispatch(self, func, args, kwargs):
        """Every op the engine does not handle specially (`_SPECIAL`)."""
        self.metrics.ops += 1
        self.device.host_us += self.spec.host_op_overhead_us
        cls = op_class(func)
        if cls is None:
            return self.run_now(func, args, kwargs, fallback=True)
        if cls == BARRIER:
            return self.run_now(func, args, kwargs, fallback=False)
        if cls == INPLACE_VIEW:
            return self._inplace_view(func, args, kwargs)
        args_t, kwargs_t, handles, inputs, vbytes = self._template(func, args, kwargs)
        key = (func, args_t, kwargs_t, _global_state())
        meta = self.meta_cache.get(key)
        if meta is None:
            meta = infer(func, args, kwargs, args_t, kwargs_t, handles)
            if len(self.meta_cache) >= 100_000:  # bound memory under ever-new shapes
                self.meta_cache.clear()
            self.meta_cache[key] = meta
        if meta is _RUN_NOW:
            # Shape inference cannot say what the op returns (a boolean mask's nonzero inside
            # index, repeat_interleave without output_size, a meta kernel that refuses what
            # CPU accepts): the op runs now on the device and the host waits for its shapes.
            return self.run_now(func, args, kwargs, fallback=False)
        if meta.resize:  # out= of the wrong shape: resized as CPU does, then the op again
            self.metrics.ops -= 1
            for j, k, size, stride in meta.resize:
                a = func._schema.arguments[j]
                v = args[j] if j < len(args) and not a.kwarg_only else kwargs[a.name]
                v = v[k] if isinstance(v, (list, tuple)) else v
                if v.numel():  # CPU's resize_output warning, word for word
                    warnings.warn(
                        f"An output with one or more elements was resized since it had shape "
                        f"{list(v.shape)}, which does not match the required output shape "
                        f"{list(size)}. This behavior is deprecated, and in a future PyTorch "
                        f"release outputs will not be resized unless they have zero elements. "
                        f"You can explicitly reuse an out tensor t by resizing it, inplace, to "
                        f"zero elements with t.resize_(0).", UserWarning,
                        stacklevel=_user_stacklevel())
                self._resize_out(v, size, stride)
            return self._dispatch(func, args, kwargs)
        new = () if meta.op is None else self._record(meta, handles, inputs, vbytes)
        return self._results(func, args, kwargs, handles, meta, new)

    def _template(self, func, args, kwargs):
        """Note [Templates] in fusion/ir.py: tensors -> ("T", ...), Scalars -> ("S", ...)."""
        spos, snames = scalar_positions(func)
        if not kwargs:  # the common case, inlined (this runs per op): tensors and plain values
            handles, where, vbytes, out = [], {}, [], []
            for i, a in enumerate(args):
                t = type(a)
                if t is NeuronTensor:
                    out.append(_enc_tensor(a, handles, where, vbytes))
                elif t in _PLAIN and i not in spos:
                    out.append(a)
                else:
                    break
            else:
                return tuple(out), (), handles, [], vbytes
        e = _Encoder(func)
        args_t = tuple([e.enc(a, i in spos) for i, a in enumerate(args)])
        kwargs_t = tuple([(k, e.enc(v, k in snames)) for k, v in kwargs.items()])
        return args_t, kwargs_t, e.handles, e.inputs, e.vbytes

    def _resize_out(self, t, size, stride) -> None:
        """An out= tensor of the wrong shape is resized, as CPU's resize_output does (the
        meta kernel already gave CPU's deprecation warning)."""
        off = t.storage_offset()
        need = _extent_bytes(size, stride, off, t.element_size())
        if need > t._handle.nbytes:
            self._grow(t, need)
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
            aten.as_strided_.default(t, size, stride, off)
        t._set_layout()

    def _grow(self, t, need: int) -> None:
        """A tensor resized past its buffer: the buffer itself grows (a new, larger
        allocation that starts with the old bytes), so every view of it sees the new storage,
        as CPU's resize_ reallocates the storage its views share."""
        h = t._handle
        self.flush("resize")
        self._make_room(need)
        buf = self.device.alloc(need)
        if h.buffer is not None and h.nbytes:
            src, dst, n = h.buffer.storage, buf.storage, h.nbytes

            def copy():
                u8 = torch.uint8
                torch.empty(0, dtype=u8).set_(dst, 0, (n,), (1,)).copy_(
                    torch.empty(0, dtype=u8).set_(src, 0, (n,), (1,)))

            with torch._C._DisableTorchDispatch():
                self.device.submit(Launch("resize_", copy, 2 * n, 0.0))
        h.buffer, h.nbytes = buf, need  # the old allocation is released with its last user

    def _inplace_view(self, func, args, kwargs):
        """squeeze_, t_, as_strided_, resize_...: change the tensor's own sizes and strides
        over the same buffer; resize_ past the buffer moves the tensor to a larger one."""
        t = args[0]
        args_t, kwargs_t, handles, _, _ = self._template(func, args, kwargs)
        metas = _meta_buffers(handles)
        m = _to_meta(t, args_t[0], metas)
        func(m, *[_to_meta(v, a, metas) for v, a in zip(args[1:], args_t[1:])],
             **{k: _to_meta(v, a, metas) for (k, v), (_, a) in zip(kwargs.items(), kwargs_t)})
        need = _extent_bytes(m.shape, m.stride(), m.storage_offset(), m.element_size())
        if need > t._handle.nbytes:
            if func.overloadpacket is not aten.resize_:
                _out_of_bounds(m.shape, m.stride(), m.storage_offset(), m.dtype,
                               t._handle.nbytes)
            self._grow(t, need)
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
            aten.as_strided_.default(t, m.shape, m.stride(), m.storage_offset())
        t._set_layout()
        return t

    def _record(self, meta, handles, inputs, vbytes):
        op = meta.op
        new_bytes = sum(op.new_bytes)
        hbm = self.device.hbm
        if hbm.used + self.pending_bytes + new_bytes > hbm.capacity:
            self._make_room(new_bytes)
        new = [Handle(b, pending=True) for b in op.new_bytes]
        if meta.f64:
            self._check_dtype(torch.float64)
        uids = tuple([h.uid for h in handles] + [h.uid for h in new])
        node = Node(op, uids, inputs, tuple(vbytes) + op.new_bytes, _source())
        cfg = _config.config
        lazy = self.is_lazy()
        if lazy:  # eager flushes every op: no open group to track
            cut = self.online.cut(self.strategy, node) if self.queue else "start"
            low = cfg.queue_low_threshold  # 0: purely lazy, never flush for idling
            if cut is not None and self.queue and low > 0 and self.device.in_flight() <= low:
                self.flush("device idle")
            self.online.add(node, cut)
        # Only now (a flush above may have written pending inputs back): hold values in HBM
        # strongly, pending ones weakly (Handle's docstring).
        node.refs = [weakref.ref(h) if h.pending else h for h in handles]
        if cfg.skip_intermediate:
            node.refs += [weakref.ref(h) for h in new]
        else:  # every value is written back: the queue keeps it alive until the flush
            node.refs += new
        self.queue.append(node)
        self.pending_bytes += new_bytes
        if not lazy:
            self.flush("eager")
        elif len(self.queue) >= cfg.buffer_size_limit:
            self.flush("buffer full")
        elif self.pending_bytes > cfg.max_pending_mb * 2**20:
            self.flush("pending memory")
        return new

    def _results(self, func, args, kwargs, handles, meta, new):
        if meta.single:  # one output (most ops): no list, no pytree
            leaf = meta.leaves[0]
            if leaf[0] == "new":
                _, k, size, stride, dtype, info = leaf
                return NeuronTensor(new[k], size, stride, 0, dtype, info=info)
            if leaf[0] == "view":
                _, li, size, stride, off, dtype, info = leaf
                if info[2] > handles[li].nbytes:
                    _out_of_bounds(size, stride, off, dtype, handles[li].nbytes)
                return NeuronTensor(handles[li], size, stride, off, dtype, info=info)
        out = []
        for leaf in meta.leaves:
            kind = leaf[0]
            if kind == "new":
                _, k, size, stride, dtype, info = leaf
                out.append(NeuronTensor(new[k], size, stride, 0, dtype, info=info))
            elif kind == "view":
                _, li, size, stride, off, dtype, info = leaf
                if info[2] > handles[li].nbytes:
                    _out_of_bounds(size, stride, off, dtype, handles[li].nbytes)
                out.append(NeuronTensor(handles[li], size, stride, off, dtype, info=info))
            elif kind == "arg":
                _, j, k = leaf
                a = func._schema.arguments[j]
                v = args[j] if j < len(args) and not a.kwarg_only else kwargs[a.name]
                out.append(v[k] if isinstance(v, (list, tuple)) else v)
            else:
                out.append(leaf[1])
        return out[0] if meta.single else tree_unflatten(out, meta.spec)

    # -- flush and sync --------------------------------------------------------------
    @_locked
    def flush(self, reason: str) -> None:
        if not self.queue:
            return
        nodes, self.queue = self.queue, []
        self.online.reset()
        self.pending_bytes = 0
        with torch._C._DisableTorchDispatch():
            report = self.runner.run(nodes, reason, self.strategy if self.is_lazy()
                                     else self.eager_strategy)
        self.last_report = report
        m = self.metrics
        m.flushes[reason] += 1
        sizes = m.group_sizes
        for k, v in report.plan.sizes.items():
            sizes[k] += v
        if self.device.blocking:
            self.synchronize()

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

    @_locked
    def read(self, t, reason: str) -> torch.Tensor:
        """Device-to-host: the current value of neuron tensor `t` as a CPU tensor."""
        if self.queue:  # a host read that cuts queued work: where (run's advice)
            src = _source()
            self.metrics.sync_sites[f"{reason}@{src[0]}:{src[1]}" if src else reason] += 1
        self.sync(reason)
        h = t._handle
        if h.poison is not None:  # Note [Poison] in fusion/program.py
            _raise_launch_error(h.poison)
        n = t.numel() * t.element_size()
        self.device.submit(Launch("d2h", None, n, 0.0, kind="dma", dma_bytes=n))
        self.device.host_us = max(self.device.host_us, self.device.free_at_us)
        self.metrics.d2h_bytes += n
        if n == 0:
            return torch.empty(t.shape, dtype=t.dtype)
        with torch._C._DisableTorchDispatch():
            return torch.empty(0, dtype=t.dtype).set_(
                h.buffer.storage, t.storage_offset(), t.shape, t.stride()).clone()

    @_locked
    def write(self, dst, src: torch.Tensor) -> None:
        """Host-to-device copy into neuron tensor `dst` (broadcast and casts as copy_)."""
        h = dst._handle
        if any(h.uid in n.uids for n in self.queue):
            self.flush("h2d")  # the copy must land after queued readers/writers of dst
        src = src.detach()
        if src.dtype == torch.float64:
            self._check_dtype(torch.float64)
            src = src.to(torch.float32)  # Note [float64 policy] in fusion/program.py
        n = src.numel() * src.element_size()
        self.device.submit(Launch("h2d", None, n, 0.0, kind="dma", dma_bytes=n))
        self.metrics.h2d_bytes += n
        with torch._C._DisableTorchDispatch():
            torch.empty(0, dtype=dst.dtype).set_(
                h.buffer.storage, dst.storage_offset(), dst.shape, dst.stride()).copy_(src)

    def run_now(self, func, args, kwargs, fallback: bool):
        """Ops that need data now: CPU fallback (sync, copy in, run, copy back) or output
        shapes only execution can tell (a device launch the host waits for)."""
        name = func._schema.name
        cfg = _config.config
        if fallback:
            if not cfg.fallback_enabled:
                raise NeuronFallbackError(
                    f"Operator '{name}' has no Neuron implementation and CPU fallback is off "
                    f"(NEURON_FALLBACK_ENABLED=0); unset it to run the op on CPU.")
            if name not in self._warned:
                self._warned.add(name)
                warnings.warn(f"Operator '{name}' fell back to CPU", UserWarning,
                              stacklevel=_user_stacklevel())
            self.metrics.cpu_fallbacks[name] += 1
        self.sync(("fallback:" if fallback else "data-dependent:") + name)
        views = {}

        def view(v):
            views[id(v)] = v
            return _buffer_view(v)

        with torch._C._DisableTorchDispatch():
            c_args = [_on_host(a, view) for a in args]
            c_kwargs = {k: _on_host(v, view) for k, v in kwargs.items()}
            nbytes_in = sum(v.numel() * v.element_size() for v in views.values())
            result = {}

            def work():
                try:
                    result["out"] = func(*c_args, **c_kwargs)
                except Exception as e:
                    if not fallback:  # a device launch: the op's error, found at the sync
                        raise LaunchError(e) from None
                    raise

            if fallback:
                self.device.submit(Launch("d2h", None, nbytes_in, 0, kind="dma",
                                          dma_bytes=nbytes_in))
                self.metrics.d2h_bytes += nbytes_in
                work()
                self.device.advance_host(self.spec.host_op_overhead_us)
            else:
                self.device.submit(Launch(name, work, nbytes_in, 0.0,
                                          context=[_FakeNode(func)]))
                self.synchronize()
            out = result["out"]
        # Outputs: tensors sharing an argument's storage stay views of its buffer.
        by_storage = {}
        for v in views.values():
            if v._handle.buffer is not None:
                by_storage[v._handle.buffer.storage.data_ptr()] = v
        leaves, spec = tree_flatten(out)
        new_leaves = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                new_leaves.append(leaf)
                continue
            if leaf.layout != torch.strided:
                raise _sparse_error(name, leaf.layout)
            owner = by_storage.get(leaf.untyped_storage().data_ptr()) if leaf.numel() else None
            if owner is not None:
                same = next((v for v in views.values() if v._handle is owner._handle
                             and v.shape == leaf.shape and v.stride() == leaf.stride()
                             and v.storage_offset() == leaf.storage_offset()), None)
                new_leaves.append(same if same is not None else self.wrap(
                    owner._handle, tuple(leaf.shape), leaf.stride(), leaf.storage_offset(),
                    leaf.dtype))
                continue
            # CPU's layout is kept (nonzero's (1, N) strides decide view-vs-copy later).
            n = _extent_bytes(leaf.shape, leaf.stride(), 0, leaf.element_size())
            self._make_room(n)
            with torch._C._DisableTorchDispatch():
                st = leaf.untyped_storage()
                if leaf.storage_offset() or st.nbytes() != n:
                    st = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype)
                    st = st.copy_(leaf).untyped_storage()
            h = Handle(n, self.device.alloc(n, st))
            if fallback:
                self.device.submit(Launch("h2d", None, n, 0, kind="dma", dma_bytes=n))
                self.metrics.h2d_bytes += n
            new_leaves.append(self.wrap(h, tuple(leaf.shape), leaf.stride(), 0, leaf.dtype))
        return tree_unflatten(new_leaves, spec)


_PLAIN = frozenset({int, float, bool, str, type(None)})  # static as they are


def _enc_tensor(v, handles: list, where: dict, vbytes: list) -> tuple:
    """("T", local buffer index) + layout; collects the buffer (once) and its bytes read."""
    h = v._handle
    li = where.get(h.uid)
    if li is None:
        if v._extent > h.nbytes:  # its storage was resized smaller (FSDP2's free)
            _out_of_bounds(v._layout[0], v._layout[1], v._layout[2], v.dtype, h.nbytes)
        li = where[h.uid] = len(handles)
        handles.append(h)
        vbytes.append(min(h.nbytes, v._vbytes))
    elif v._vbytes > vbytes[li]:
        vbytes[li] = min(h.nbytes, v._vbytes)
    return ("T", li) + v._layout


class _Encoder:
    """Builds a node's templates; a class, not a closure, so no reference cycle keeps the
    handles it collected (and so the values they name) alive past the call."""

    def __init__(self, func):
        self.func = func
        self.handles: list[Handle] = []
        self.where: dict[int, int] = {}
        self.inputs: list = []
        self.vbytes: list[int] = []

    def enc(self, v, scalar):
        if type(v) is NeuronTensor:
            return _enc_tensor(v, self.handles, self.where, self.vbytes)
        if isinstance(v, torch.Generator):
            raise _generator_error(v)
        if isinstance(v, torch.Tensor):
            if v.device.type != "cpu" or (v.dim() != 0 and self.func is not aten.copy_.default):
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least "
                    f"two devices, {DEVICE} and {v.device}! (in {self.func._schema.name}; "
                    f"move the tensor with .to('neuron'))")
            self.inputs.append(v.detach().clone())
            return ("H", len(self.inputs) - 1, str(v.dtype)[6:], tuple(v.shape))
        if scalar and isinstance(v, (int, float, bool, complex)):
            self.inputs.append(v)
            return ("S", len(self.inputs) - 1, type(v).__name__)
        if scalar and isinstance(v, (list, tuple)) and v and all(
                isinstance(x, (int, float, bool, complex)) for x in v):
            self.inputs.append(list(v))  # a Scalar[]: runtime values, keyed by types only
            return ("S", len(self.inputs) - 1, tuple(type(x).__name__ for x in v))
        if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            return ("L",) + tuple(self.enc(x, scalar) for x in v)
        return encode_static(v)


class _FakeNode:
    def __init__(self, func):
        self.func = func
        self.source = _source()


def _on_host(v, tensor):
    """Argument v for a host call: neuron tensors replaced by `tensor(t)`, the neuron device
    by the CPU (recursing into lists and tuples)."""
    if isinstance(v, NeuronTensor):
        return tensor(v)
    if isinstance(v, torch.Generator):
        raise _generator_error(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_on_host(x, tensor) for x in v)
    if isinstance(v, torch.device) and v.type == DEVICE.type:
        return torch.device("cpu")
    return v


def _buffer_view(v):
    """A host tensor viewing neuron tensor v's device buffer (the same bytes)."""
    h = v._handle
    if v.numel() == 0 or h.buffer is None:
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype)
    return torch.empty(0, dtype=v.dtype).set_(
        h.buffer.storage, v.storage_offset(), v.shape, v.stride())


def _package_version() -> str:
    try:
        from importlib.metadata import version
        return version("adaptive-eager")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "0+unknown"


# -- ops the engine handles itself -----------------------------------------------------
def _copy_(eng, func, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, NeuronTensor) and isinstance(src, NeuronTensor):
        return eng._dispatch(func, args, kwargs)
    eng.metrics.ops += 1
    if isinstance(dst, NeuronTensor):  # host -> device
        if src.dim() == 0:
            return eng._dispatch(func, args, kwargs)
        eng.write(dst, src)
        return dst
    with torch._C._DisableTorchDispatch():  # device -> host
        dst.copy_(eng.read(src, "d2h"))
    return dst


def _to_copy(eng, func, args, kwargs):
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type == "cpu":
        eng.metrics.ops += 1
        cpu = eng.read(args[0], "cpu")
        kw = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking")}
        with torch._C._DisableTorchDispatch():
            return aten._to_copy.default(cpu, **kw)
    return eng._dispatch(func, args, kwargs)


def _local_scalar_dense(eng, func, args, kwargs):
    eng.metrics.ops += 1
    v = eng.read(args[0], "item")
    with torch._C._DisableTorchDispatch():
        return v.item()


def _materialized(op):
    """Conjugate and negative views carry a bit our wrapper tensors cannot honour: computed
    as a new tensor instead (`z.conj()` equals CPU's values; `is_conj()` is False)."""
    def run(eng, func, args, kwargs):
        return eng._dispatch(op, args, kwargs)
    return run


def _unsafe_view(eng, func, args, kwargs):
    return eng.dispatch(aten.view.default, args, kwargs)


def _set_(eng, func, args, kwargs):
    raise RuntimeError(f"{func._schema.name} (Tensor.set_) is not supported on neuron tensors; "
                       f"use copy_ or a new tensor.")


_PYTHON_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.Python)
                | torch._C.DispatchKeySet(torch._C.DispatchKey.PythonTLSSnapshot))

_SPECIAL = {
    aten.copy_.default: _copy_,
    aten._to_copy.default: _to_copy,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten._unsafe_view.default: _unsafe_view,
    aten._conj.default: _materialized(aten.conj_physical.default),
    aten._neg_view.default: _materialized(aten.neg.default),
}
for _op in aten.set_.overloads():
    _SPECIAL[getattr(aten.set_, _op)] = _set_

ENGINE = Engine()
