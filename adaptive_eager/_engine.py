"""The engine: every ATen op on a neuron tensor lands in `Engine.dispatch`.

Three steps per op (as jax's dispatch): abstract specs (meta execution, cached per
signature, so shape/dtype errors raise at the call), a queued node, and a flush that turns
queued nodes into launches. In eager mode every op flushes at once; in adaptive mode the
queue is flushed at sync points, boundaries, a full buffer, or when the device runs idle.
"""
from __future__ import annotations

import os
import sys
import threading
import traceback
import warnings
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

import device as _dev
import fusion
from device import Device, DeviceError, DeviceSpec, Launch
from fusion.cache import ExecutableCache
from fusion.flush import Runner
from fusion.ir import Handle, Node, OpSig, encode_static, scalar_positions
from fusion.ops import BARRIER, CONTRACTION, INPLACE_VIEW, RANDOM, VIEW, op_class
from fusion.partition import STRATEGIES, OnlineGroup

from . import config as _config
from .metrics import Metrics

aten = torch.ops.aten
DEVICE = None  # torch.device("neuron", 0), set by registration
NeuronTensor = None  # the tensor class, set by _tensor (which imports this module)
_SKIP_FILES = tuple(os.path.dirname(m.__file__) + os.sep
                    for m in (torch, _dev, fusion, sys.modules[__name__.rpartition(".")[0]]))
_SKIP_FILES += ("<frozen", os.path.join(os.path.dirname(os.__file__), "contextlib.py"))


class NeuronRuntimeError(RuntimeError):
    """An error the device found while running an op, raised at the next sync point."""

    def __init__(self, op: str, message: str, source):
        self.op = op
        self.source = source
        where = f'File "{source[0]}", line {source[1]}' if source else "unknown"
        if source and source[2]:
            where += "\n" + source[2]
        super().__init__(f"An error occurred on Neuron for operation={op}; "
                         f"error message={message}; python stack trace={where}")


def _runtime_error(launch) -> NeuronRuntimeError:
    """The user-facing error for a failed launch: its op and the user's source line."""
    err = launch.error
    k = getattr(err, "instr_index", 0)
    node = launch.context[k] if launch.context else None
    op = node.func._schema.name if node is not None else launch.name
    return NeuronRuntimeError(op, f"{type(err).__name__}: {err}",
                              node.source if node is not None else None)


class NeuronFallbackError(RuntimeError):
    """A device op could not run and CPU recovery is turned off."""


_RUN_NOW = object()  # meta cache entry: shape inference cannot answer, the op runs at once


class MetaResult:
    """What an op signature produces, computed once by meta execution (see Engine.infer)."""

    __slots__ = ("leaves", "spec", "single", "f64", "op", "resize")

    def __init__(self, leaves, spec, op, resize=()):
        self.resize = resize  # out= tensors to resize first: (arg index, list index, size, stride)
        self.single = spec.is_leaf()  # one output: no pytree rebuild per call
        self.op = op  # the node signature to queue, or None (views, metadata: nothing runs)
        self.f64 = op is not None and any(o is not None and o[4] == "float64" for o in op.outs)
        self.leaves = leaves  # per leaf: ("new", k, size, stride, dtype, info) |
        # ("view", li, size, stride, off, dtype, info) | ("arg", schema index, list index) |
        # ("value", v); info: what NeuronTensor caches (see NeuronTensor.__new__)
        self.spec = spec


def _info(size, stride, offset, t) -> tuple:
    """(layout, view bytes, extent bytes) a NeuronTensor caches, from its meta twin."""
    return ((size, stride, offset, str(t.dtype)[6:]), t.numel() * t.element_size(),
            _extent_bytes(size, stride, offset, t.element_size()))


def _extent_bytes(size, stride, offset, itemsize) -> int:
    if any(s == 0 for s in size):
        return 0
    return (offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1) * itemsize


def _locked(method):
    """Run an engine entry point under the engine lock (Note [Threads])."""
    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    locked.__name__, locked.__doc__ = method.__name__, method.__doc__
    return locked


class Engine:
    def __init__(self):
        self.metrics = Metrics()
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
        self.adaptive = cfg.adaptive
        if cfg.strategy not in STRATEGIES:
            raise ValueError(f"unknown fusion strategy {cfg.strategy!r}; "
                             f"choose one of {sorted(STRATEGIES)}")
        self.strategy = STRATEGIES[cfg.strategy](self.spec, cfg.max_group_ops,
                                                 cfg.max_group_contractions)
        self.eager_strategy = STRATEGIES["none"](self.spec)  # eager: one op per launch
        cache_dir = None if cfg.disable_disk_cache else cfg.cache_dir
        salt = "|".join([_package_version(), torch.__version__, "executor=eager",
                         self.spec.fingerprint()])
        old = getattr(self, "runner", None)
        if old is None or old.cache.directory != cache_dir or old.device is not self.device \
                or (old.cache.max_entries, old.cache.max_bytes) != (
                    cfg.cache_max_entries,
                    None if cfg.cache_max_mb is None else int(cfg.cache_max_mb * 2**20)):
            cache = ExecutableCache(cache_dir, max_entries=cfg.cache_max_entries,
                                    max_mb=cfg.cache_max_mb, salt=salt)
            self.runner = Runner(self.device, cache)

    @_locked
    def set_adaptive(self, on: bool) -> None:
        if on != self.adaptive:
            self.flush("mode switch")
        _config.config.adaptive = self.adaptive = bool(on)

    @_locked
    def set_strategy(self, name: str) -> None:
        if name not in STRATEGIES:
            raise ValueError(f"unknown fusion strategy {name!r}; choose one of "
                             f"{sorted(STRATEGIES)}")
        self.flush("strategy switch")
        _config.config.strategy = name
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
                return _hand_off(e)  # Note [Device-thread errors]
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
            meta = self.infer(func, args, kwargs, args_t, kwargs_t, handles)
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

    def infer(self, func, args, kwargs, args_t, kwargs_t, handles) -> MetaResult:
        """Meta execution: output shapes/dtypes/strides, aliasing, FLOPs. User errors
        (shapes, dtypes) propagate with PyTorch's own message."""
        metas = _meta_buffers(handles)

        m_args = [_to_meta(v, t, metas) for v, t in zip(args, args_t)]
        m_kwargs = {k: _to_meta(v, t, metas) for (k, v), (_, t) in zip(kwargs.items(), kwargs_t)}
        with warnings.catch_warnings(record=True) as meta_warnings:
            warnings.simplefilter("always")
            try:
                out = func(*m_args, **m_kwargs)
            except Exception as e:  # no meta kernel, data-dependent shapes, or a user error
                meta_error = e
            else:
                meta_error = None
        cls = op_class(func)
        probe = None
        if meta_error is not None or _worth_probing(cls, handles, args_t, kwargs_t):
            probe = _probe(func, args, kwargs, args_t, kwargs_t, handles)
            if isinstance(probe, BaseException):  # CPU refuses it too: CPU's error, at the call
                probe._ae_user_error = True
                raise probe
        if meta_error is not None:
            return _RUN_NOW
        out = _cpu_shaped(func, m_args, m_kwargs, out)
        storage_li = {m.untyped_storage()._cdata: li for li, m in enumerate(metas)}
        leaves, spec = tree_flatten(out)
        rets = func._schema.returns
        schema_args = func._schema.arguments
        ret_alias = []
        for r in rets:
            ai = r.alias_info
            if ai is None or not ai.before_set:  # lists keep it on the element type
                ret_alias.append(None)
                continue
            j = next(j for j, a in enumerate(schema_args)
                     if a.alias_info is not None and a.alias_info.before_set & ai.before_set)
            ret_alias.append((j, ai.is_write))
        per_ret = out if len(rets) > 1 else (out,)
        leaf_alias = []
        for r, o in zip(ret_alias, per_ret):
            n = len(tree_flatten(o)[0])
            leaf_alias += [(r, k) for k in range(n)]
        cpu_leaves = tree_flatten(probe)[0] if probe is not None else ()
        out_leaves, outs, new_bytes, resize = [], [], [], []
        nh = len(handles)
        for i, leaf in enumerate(leaves):
            alias = leaf_alias[i][0] if i < len(leaf_alias) else None
            if not isinstance(leaf, torch.Tensor):
                out_leaves.append(("value", leaf))
                outs.append(None)
                continue
            size, stride, off = tuple(leaf.shape), leaf.stride(), leaf.storage_offset()
            dt = str(leaf.dtype)[6:]
            li = storage_li.get(leaf.untyped_storage()._cdata)
            if alias is not None and alias[1]:  # in-place or out=: hand back the argument
                j, k = alias[0], leaf_alias[i][1]
                out_leaves.append(("arg", j, k))
                outs.append(None)
                t = args_t[j] if j < len(args_t) else dict(kwargs_t).get(schema_args[j].name)
                t = t[1 + k] if t[0] == "L" else t
                if (size, stride) != (t[2], t[3]):  # the meta kernel resized an out= tensor
                    resize.append((j, k, size, stride))
            elif (alias is not None or cls == VIEW) and li is not None:
                out_leaves.append(("view", li, size, stride, off, leaf.dtype,
                                   _info(size, stride, off, leaf)))
                outs.append(None)
            else:
                cpu = cpu_leaves[i] if i < len(cpu_leaves) else None
                if (isinstance(cpu, torch.Tensor) and tuple(cpu.shape) == size
                        and (cpu.stride() != stride or cpu.dtype != leaf.dtype)):
                    # Note [CPU layouts]: where a meta kernel lays out or types an output
                    # unlike CPU's kernel, CPU wins (view-vs-copy semantics depend on it).
                    stride, dt = cpu.stride(), str(cpu.dtype)[6:]
                    leaf = torch.empty_strided(size, stride, dtype=cpu.dtype, device="meta")
                k = len(new_bytes)
                out_leaves.append(("new", k, size, stride, leaf.dtype,
                                   _info(size, stride, 0, leaf)))
                outs.append(("N", nh + k, size, stride, dt))
                new_bytes.append(_extent_bytes(size, stride, off, leaf.element_size()))
        writes = []
        for j, a in enumerate(schema_args):
            if a.alias_info is not None and a.alias_info.is_write:
                t = args_t[j] if j < len(args_t) else dict(kwargs_t).get(a.name)
                if t is None:
                    continue
                for x in (t[1:] if t[0] == "L" else (t,)):
                    if type(x) is tuple and x[0] == "T" and x[1] not in writes:
                        writes.append(x[1])
        flops = _flops(func, m_args, m_kwargs, out)
        outs = tuple(outs) if new_bytes else None
        op = None
        if outs is not None or writes:
            op = OpSig(func, cls, args_t, kwargs_t, outs or (), len(handles), writes, flops,
                       tuple(new_bytes))
        if not resize:  # (a resize gives CPU's warning on every call, in _dispatch)
            for w in meta_warnings:
                warnings.warn(w.message, w.category, stacklevel=_user_stacklevel())
        return MetaResult(tuple(out_leaves), spec, op, tuple(resize))

    def _resize_out(self, t, size, stride) -> None:
        """An out= tensor of the wrong shape is resized, as CPU's resize_output does (the
        meta kernel already gave CPU's deprecation warning)."""
        off = t.storage_offset()
        if _extent_bytes(size, stride, off, t.element_size()) <= t._wrapper_nbytes:
            with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):
                aten.as_strided_.default(t, size, stride, off)
            t._set_layout()
            return
        # A wrapper's extent is fixed when it is made: growing means a new buffer, and the
        # user's tensor object takes the new tensor's place (its old values are dropped;
        # the op overwrites every element).
        try:
            torch.utils.swap_tensors(t, self.empty(tuple(size), tuple(stride), t.dtype))
        except RuntimeError as e:
            raise RuntimeError(
                f"out= tensor of shape {tuple(t.shape)} must grow to {tuple(size)} and cannot "
                f"be resized in place here ({e}); pass an out= tensor of shape "
                f"{tuple(size)}") from None

    def _inplace_view(self, func, args, kwargs):
        """squeeze_, t_, as_strided_, resize_...: change the tensor's own sizes and strides
        over the same buffer (resize_ cannot grow past the allocation the tensor was made
        with: a wrapper tensor's extent is fixed when it is created)."""
        t = args[0]
        args_t, kwargs_t, handles, _, _ = self._template(func, args, kwargs)
        metas = _meta_buffers(handles)
        m = _to_meta(t, args_t[0], metas)
        func(m, *[_to_meta(v, a, metas) for v, a in zip(args[1:], args_t[1:])],
             **{k: _to_meta(v, a, metas) for (k, v), (_, a) in zip(kwargs.items(), kwargs_t)})
        need = _extent_bytes(m.shape, m.stride(), m.storage_offset(), m.element_size())
        if need > t._wrapper_nbytes:  # fixed when the wrapper was made
            raise RuntimeError(
                f"{func._schema.name}: growing a neuron tensor beyond its allocation "
                f"({t._wrapper_nbytes} bytes, {need} needed) is not supported; allocate a new "
                f"tensor (torch.empty(..., device='neuron')) and copy into it.")
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
        m.launches += report.launches
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
            raise _runtime_error(e.launch) from e.launch.error

    @_locked
    def sync(self, reason: str) -> None:
        self.flush(reason)
        self.synchronize()

    @_locked
    def read(self, t, reason: str) -> torch.Tensor:
        """Device-to-host: the current value of neuron tensor `t` as a CPU tensor."""
        self.sync(reason)
        h = t._handle
        if h.poison is not None:  # Note [Poison] in fusion/program.py
            raise _runtime_error(h.poison) from h.poison.error
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
                result["out"] = func(*c_args, **c_kwargs)

            if fallback:
                self.device.submit(Launch("d2h", None, nbytes_in, 0, kind="dma",
                                          dma_bytes=nbytes_in))
                self.metrics.d2h_bytes += nbytes_in
                work()
                self.device.advance_host(self.spec.host_op_overhead_us)
            else:
                self.device.submit(Launch(name, work, nbytes_in, 0.0,
                                          context=[_FakeNode(func)]))
                self.metrics.launches += 1
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
        if v._wrapper_nbytes > h.nbytes:  # its storage was resized smaller (FSDP2's free)
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


_BN = {"native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training"}


def _cpu_shaped(func, m_args, m_kwargs, out):
    """Where CPU kernels shape outputs unlike the meta kernels: eval-mode batch norm returns
    empty saved statistics on CPU (meta says (C,)). Our device follows CPU."""
    if func.overloadpacket.__name__ not in _BN:
        return out
    names = [a.name for a in func._schema.arguments]
    training = (m_kwargs.get("training", m_args[names.index("training")]
                             if "training" in names and names.index("training") < len(m_args)
                             else False))
    if training:
        return out
    return (out[0],) + tuple(o.new_empty(0) for o in out[1:3]) + tuple(out[3:])


def _out_of_bounds(size, stride, off, dtype, nbytes):
    """CPU's error for a view that would address memory outside its buffer."""
    need = _extent_bytes(size, stride, off, dtype.itemsize)
    e = RuntimeError(f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset "
                     f"{off}, and itemsize {dtype.itemsize} requiring a storage size of {need} "
                     f"are out of bounds for storage of size {nbytes}")
    e._ae_user_error = True
    raise e


def _global_state() -> tuple:
    """The global state that meta execution (and so a cached MetaResult) depends on."""
    return (
        torch.get_default_dtype(),  # `int_tensor / 2`, factories without dtype=
        torch.is_grad_enabled(),  # ops that branch on grad mode (batch norm stats, ...)
        torch.is_inference_mode_enabled(),  # inference tensors behave differently
        torch.are_deterministic_algorithms_enabled(),  # kernels that refuse or change
        torch.is_autocast_enabled("neuron"),  # autocast state seen by composite ops
    )


# Note [CPU probe]: meta kernels are not CPU's kernels. Some lay out or type outputs unlike
# CPU (floor_divide on a transposed input, `bool ** False`), some accept what CPU refuses
# (`float & float`, mm of float32 by float64), some refuse what CPU accepts (empty inputs).
# On a new signature the op also runs on CPU over blank host buffers shaped and aliased like
# the device buffers; CPU's answer wins. The probe is skipped where it would cost real time
# (big buffers; contractions of one dtype, whose layouts meta gets right) and for random ops
# (they would draw from the generator). A probe error counts only if CPU raises it for two
# different fillings (zeros and ones), so value checks (a zero divisor, index 1 of a size-1
# dim) are not mistaken for user errors; those are found at run time as on the device.
_PROBE_MAX_BYTES = 16 * 2**20


def _worth_probing(cls, handles, args_t, kwargs_t) -> bool:
    if cls == RANDOM or sum(h.nbytes for h in handles) > _PROBE_MAX_BYTES:
        return False
    if cls == CONTRACTION:
        return len({t[5] for t in _tensor_templates(args_t + tuple(v for _, v in kwargs_t))}) > 1
    return True


def _tensor_templates(ts):
    for t in ts:
        if type(t) is tuple and t:
            if t[0] == "T":
                yield t
            elif t[0] == "L":
                yield from _tensor_templates(t[1:])


def _probe(func, args, kwargs, args_t, kwargs_t, handles):
    """CPU's result (or the exception CPU raises) for this op over blank host buffers."""
    first = None
    for fill in (0, 1):
        bufs = [torch.zeros(h.nbytes, dtype=torch.uint8) for h in handles]

        def twin(v, t):
            if type(t) is tuple and t and t[0] == "T":
                _, li, size, stride, off, dt = t
                x = torch.empty(0, dtype=getattr(torch, dt)).set_(
                    bufs[li].untyped_storage(), off, size, stride)
                if fill:
                    x.fill_(fill)
                return x
            if type(t) is tuple and t and t[0] == "L":
                return [twin(x, tt) for x, tt in zip(v, t[1:])]
            if isinstance(v, torch.device) and v.type == DEVICE.type:
                return torch.device("cpu")
            return v

        with torch._C._DisableTorchDispatch(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                c_args = [twin(v, t) for v, t in zip(args, args_t)]
                c_kwargs = {k: twin(v, t) for (k, v), (_, t) in zip(kwargs.items(), kwargs_t)}
                return func(*c_args, **c_kwargs)
            except Exception as e:
                if first is not None and type(e) is type(first):
                    return first.with_traceback(None)
                if first is not None:
                    return None  # a value check, not a user error: let the device find it
                first = e
    return None


_HANDOFF: list = []  # errors raised on autograd's device thread, for the caller (_surface)
_HANDOFF_LOCK = threading.Lock()


def _hand_off(e: BaseException) -> str:
    """Note [Device-thread errors]: autograd runs a neuron backward on its own device thread,
    where a Python exception unwinding through PyTorch's Python device guard aborts the
    process (the guard calls into Python while the error is pending). There the error is
    handed over instead: the op returns a value the dispatcher refuses with a C++ error,
    which autograd carries to the caller safely, and the backward wrapper in
    _registration re-raises the original exception."""
    with _HANDOFF_LOCK:
        _HANDOFF.append(e)
    return f"<{type(e).__name__} on autograd's device thread: {e}>"


def take_handoff() -> BaseException | None:
    """The first error handed over from autograd's device thread, if any (clears them)."""
    with _HANDOFF_LOCK:
        if not _HANDOFF:
            return None
        first = _HANDOFF[0]
        _HANDOFF.clear()
        return first


def _meta_buffers(handles) -> list:
    """One meta byte buffer per device buffer: meta twins of views share them, so aliasing
    and storage offsets behave in shape inference as on the device."""
    return [torch.empty(0, dtype=torch.uint8, device="meta").set_(
        torch.UntypedStorage(h.nbytes, device="meta"), 0, (h.nbytes,), (1,)) for h in handles]


def _to_meta(v, t, metas):
    """The meta twin of argument v (template t): same sizes, strides, offsets, aliasing."""
    if type(t) is tuple and t and t[0] == "T":
        _, li, size, stride, off, dt = t
        return torch.empty(0, dtype=getattr(torch, dt), device="meta").set_(
            metas[li].untyped_storage(), off, size, stride)
    if type(t) is tuple and t and t[0] == "L":
        return [_to_meta(x, tt, metas) for x, tt in zip(v, t[1:])]
    if isinstance(v, torch.device) and v.type == DEVICE.type:
        return torch.device("meta")  # a device= argument must not allocate (or draw) for real
    return v


def _generator_error(g) -> RuntimeError:
    """As CUDA: a device op refuses a generator of another device (and a neuron generator
    cannot be made: README, known gaps)."""
    return RuntimeError(f"Expected a '{DEVICE.type}' device type for generator but found "
                       f"'{g.device.type}'")


def _sparse_error(op: str, layout) -> NotImplementedError:
    """Sparse results (`to_sparse`, `sparse_coo_tensor(..., device="neuron")`) are refused."""
    return NotImplementedError(
        f"{op}: sparse layouts (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, "
        f"torch.sparse_bsr, torch.sparse_bsc) are not supported on the neuron device, which "
        f"holds strided tensors only (this result would be {layout}). Keep sparse tensors on "
        f"the CPU.")


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


def _user_stacklevel() -> int:
    """The `stacklevel` that points a warning at the user's line, not at our frames."""
    f, level = sys._getframe(1), 1
    while f is not None and f.f_code.co_filename.startswith(_SKIP_FILES):
        f, level = f.f_back, level + 1
    return level


def _source():
    """(file, line, stack) of the user's code that issued the op."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_SKIP_FILES):
        f = f.f_back
    if f is None:
        return None
    stack = None
    if _config.config.stack_trace:
        stack = "".join(traceback.format_stack(f))
    return (f.f_code.co_filename, f.f_lineno, stack)


def _flops(func, args, kwargs, out) -> float:
    from torch.utils.flop_counter import flop_registry
    f = flop_registry.get(func.overloadpacket)
    if f is not None:
        try:
            return float(f(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not take these args: count elements
            pass
    return float(sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)))


def _package_version() -> str:
    try:
        from importlib.metadata import version
        return version("adaptive-eager")
    except Exception:
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
