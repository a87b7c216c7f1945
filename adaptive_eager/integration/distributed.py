"""torch.distributed on neuron tensors (c10d glue): gloo carries the bytes, the device
accounts for them.

Note [Collectives]: a c10d op on neuron tensors (`c10d::allreduce_`, `c10d::send`, ...) is a
device op, never a CPU fallback. The engine flushes its queue first (reason `collective`:
a boundary in adaptive mode, as in the reference), then gloo runs the op over host views of
the device buffers (the same bytes: no copy in or out) with the group's backend for the
neuron device, and the device queue gets one
collective launch whose time comes from the ring/tree model in device/interconnect.py.
Errors gloo raises (mismatched sizes, a closed peer) surface at the call, in PyTorch's words.
An async op returns gloo's own Work: `.wait()` waits for the bytes, as with any backend, and
the values are not to be read before it (as on CUDA); its results are the neuron tensors
(Note [Work results]). Functional collectives (DTensor,
tensor parallel) are composed from these: Note [Functional collectives].
"""
from __future__ import annotations

import os
import sys
import threading
import weakref

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

from device import Launch
from device.interconnect import BARRIER, P2P, RING_ALL_REDUCE, RING_GATHER, TREE, collective_us

from .. import patches
from ..engine import engine as _engine, handlers
from ..engine.tensor import NeuronTensor
from ..errors import _raise_launch_error
from ..engine.templates import _two_devices
from ..engine.transfer import buffer_view, on_host
from . import sync_batch_norm

DEVICE_TYPE = "neuron"

# c10d op -> (cost pattern, the argument whose bytes are the collective's size, counted as
# nccl-tests count it: all-reduce the tensor, all-gather the gathered output, reduce-scatter
# and all-to-all the input, tree ops and P2P this rank's tensors).
_COLLECTIVES = {
    "allreduce_": (RING_ALL_REDUCE, "tensors"),
    "allreduce_coalesced_": (RING_ALL_REDUCE, "tensors"),
    "allgather_": (RING_GATHER, "output_tensors"),
    "_allgather_base_": (RING_GATHER, "output_tensor"),
    "allgather_coalesced_": (RING_GATHER, "output_lists"),
    "allgather_into_tensor_coalesced_": (RING_GATHER, "outputs"),
    "reduce_scatter_": (RING_GATHER, "input_tensors"),
    "_reduce_scatter_base_": (RING_GATHER, "input_tensor"),
    "reduce_scatter_tensor_coalesced_": (RING_GATHER, "inputs"),
    "alltoall_": (RING_GATHER, "input_tensors"),
    "alltoall_base_": (RING_GATHER, "input"),
    "broadcast_": (TREE, "tensors"),
    "reduce_": (TREE, "tensors"),
    "gather_": (TREE, "input_tensors"),
    "scatter_": (TREE, "output_tensors"),
    "send": (P2P, "tensors"),
    "recv_": (P2P, "tensors"),
    "recv_any_source_": (P2P, "tensors"),
    "barrier": (BARRIER, None),
    "monitored_barrier_": (BARRIER, None),
}

_NEURON_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
_done = False


def register() -> None:
    """gloo is the default backend for neuron (PyTorch's device-to-backend map, the slot
    it keeps for third-party devices) and a gloo group carries neuron tensors; c10d ops on
    neuron tensors reach `collective`. Idempotent."""
    global _done
    if _done or not dist.is_available():
        return
    backend = dist.Backend
    backend.default_device_backend_map.setdefault(DEVICE_TYPE, backend.GLOO)
    capability = backend.backend_capability[backend.GLOO]
    if DEVICE_TYPE not in capability:
        capability.append(DEVICE_TYPE)  # `backend="gloo"` covers neuron tensors too
    if "neuron" not in backend.backend_list:  # Note [The neuron backend]
        backend.register_backend("neuron", _neuron_backend, extended_api=True,
                                 devices=[DEVICE_TYPE, "cpu"])
    for name in _COLLECTIVES:
        packet = getattr(torch.ops.c10d, name)
        for overload in packet.overloads():
            handlers.handle(getattr(packet, overload), collective)
    _register_functional()
    _route_work_results()
    _release_works_at_destroy()
    _engine.AT_SYNC.append(_release)  # Note [Gloo's thread and the GIL]
    for op, kernel in sync_batch_norm.KERNELS.items():  # Note [SyncBatchNorm ops]
        handlers.handle(op, _functional(kernel))
    patches.after_import("torch.distributed.pipelining.stage", _patch_pipeline_stage)
    patches.after_import("torch.distributed.checkpoint._state_dict_stager", _patch_stager)
    # the step `ae.explain()` reports communication for (Note [Collective stream])
    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(_new_step)
    _done = True


def _new_step(optimizer, args, kwargs) -> None:
    for eng in _engine.ENGINES:
        eng.device.new_step()


# Note [The neuron backend]: `init_process_group("neuron")` (accelerate's multi-process neuron
# path asks c10d for it by name) makes a gloo group, for neuron tensors and CPU tensors alike
# (CPU ones: accelerate's and Lightning's object collectives).
# It is gloo made as `init_process_group("gloo")` makes it, registered as a c10d plugin
# (`dist.get_backend()` says "neuron"): collectives on neuron tensors are device ops as with
# gloo (Note [Collectives]). The default for neuron tensors in a group made with no backend
# stays gloo itself.
# Under torchrun, making the default group makes core LOCAL_RANK the current one (of the
# calling thread), if this process sees it: accelerate's PartialState takes the process's
# device as `torch.neuron.current_device()` right after `init_process_group("neuron")`, and
# gives DDP `device_ids=[local_rank]` (accelerate 1.15, state.py and accelerator.py). Left on
# core 0, rank 1's Trainer put its model on neuron:0 and DDP its batches on neuron:1 (issue 25).
# A `set_device` after it wins, as always.
def _neuron_backend(opts, backend_options):
    local = os.environ.get("LOCAL_RANK", "")
    if not dist.is_initialized() and local.isdigit() and int(local) < _engine.visible_cores():
        _engine.set_current(int(local))  # the default group is being made (WORLD is unset)
    pg = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, timeout=opts.timeout)
    pg.options.global_ranks_in_group = opts.global_ranks_in_group
    pg.options.group_name = opts.group_id
    pg._set_sequence_number_for_group()
    return pg


# Note [Work results]: gloo's Work holds the host views a collective ran over; its `result()`
# and its future's value handed those CPU tensors back where CUDA hands back the CUDA tensors
# (`v + a` raised the two-devices error, and writing through `v` bypassed adaptive mode's
# queue: a queued `a * 2` saw it). They are mapped back to the neuron tensors they view.
_DEVICE_OF: dict = {}  # id(host view) -> (weakref to it, the neuron tensor it views)


def _remember(v, t):
    ref = weakref.ref(v, lambda _, k=id(v): _DEVICE_OF.pop(k, None))
    _DEVICE_OF[id(v)] = (ref, t)
    return ref


def _device_tensor(v):
    entry = _DEVICE_OF.get(id(v)) if isinstance(v, torch.Tensor) else None
    return entry[1] if entry is not None and entry[0]() is v else v


def _on_device(value):
    return tree_map(_device_tensor, value)


def _route_work_results() -> None:
    work = dist.Work
    if patches.is_patched(work, "result"):
        return
    result, get_future = work.result, work.get_future

    def work_result(self):
        return _on_device(result(self))

    def work_get_future(self):
        fut = get_future(self)
        return fut.then(lambda f: _on_device(f.value()))
    for name, new in (("result", work_result), ("get_future", work_get_future)):
        patches.patch(work, name, new, rests_on="c10d's Work.result/get_future: a collective "
                                                "we ran on host copies hands out device tensors")
    wait = work.wait
    global _GLOO_WAIT
    _GLOO_WAIT = wait

    def work_wait(self, *args, **kwargs):
        done = wait(self, *args, **kwargs)
        _release()  # Note [Gloo's thread and the GIL]
        entry = _ISSUED.get(id(self))
        if entry is not None and entry[0] is self:  # Note [Collective stream] in device/core.py
            if _on_side_stream(entry[1]):  # that stream waits, not compute: first use joins
                return done
            del _ISSUED[id(self)]
            _, eng, end_us, buffers = entry
            with eng.lock:
                eng.device.unpend(buffers, end_us)
        return done
    patches.patch(work, "wait", work_wait,
                  rests_on="Work.wait as the join of a collective we issued (Note [Overlap])")


# Note [Overlap]: a collective runs on the device's collective stream (Note [Collective
# stream] in device/core.py): its issue is not a join, its `Work.wait()` is (every
# synchronous collective is issued then waited for at once by torch.distributed, so it is
# all exposed), and so is the first launch that uses its tensors (DDP's reducer waits in
# C++, where Python cannot see it: the optimizer's first read of a gradient is the join).
# A wait under another stream than the default one (FSDP2 all-gathers and reduce-scatters
# on streams of its own, and overlaps them by events) makes that stream wait, as on CUDA:
# the compute stream joins at its first use of the tensors (FSDP2's copy-out, after its
# `wait_event`) or at a sync. Streams multiplex compute onto one hardware queue
# (integration/neuron.py): only collectives overlap.
# The bytes are gloo's: a launch that uses the tensors first waits for gloo's Work too, so
# an async collective's result is never read half-written. In adaptive mode the issue is
# still a flush (gloo reads the bytes when it is issued; the reference queues it), the wait
# is not (it only joins the streams).
_GLOO_WAIT = None  # dist.Work.wait before the patch


def _on_side_stream(eng) -> bool:
    """Is a stream other than the default one current on this core (FSDP2's all-gather and
    reduce-scatter streams)? A wait there makes that stream wait, as on CUDA."""
    from . import neuron
    return neuron.current_stream(eng.index) != neuron.default_stream(eng.index)
_ISSUED: dict = {}  # id(Work) -> (Work, engine, end on the collective stream, buffers)


def _pend(eng, end_us, buffers, out) -> None:
    works = [dist.Work.unbox(w) for w in tree_flatten(out)[0]
             if isinstance(w, torch.ScriptObject) and "c10d.Work" in str(w._type())]
    eng.device.pend(buffers, end_us, (lambda w=works[0]: _WAIT(w)) if works else None)
    for key in [k for k, e in _ISSUED.items()  # joined since (a launch used its tensors)
                if e[1] is eng and e[2] <= eng.device.free_at_us and e[0].is_completed()]:
        del _ISSUED[key]
    for w in works:
        _ISSUED[id(w)] = (w, eng, end_us, buffers)


def _WAIT(work) -> None:
    """gloo's own wait (the bytes), never the timeline's join: the caller joins."""
    _GLOO_WAIT(work)


def collective(eng, func, args, kwargs):
    """One c10d op on neuron tensors: a boundary, then gloo over the device buffers, then a
    costed collective launch (Note [Collectives]). Runs under the engine lock."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, NeuronTensor)]
    for t in tensors:  # CUDA's rule (another core's queue was not flushed: garbage was sent)
        if t._engine is not eng:
            raise _two_devices(eng, t.device, func)
    eng.metrics.ops += 1
    eng.device.advance_host(eng.spec.host_op_overhead_us)
    eng.flush("collective")
    pattern, size_arg = _COLLECTIVES[func._schema.name.split("::")[1]]
    for t in tensors:
        if t._handle.poison is not None:  # Note [Poison] in fusion/program.py: as a read,
            eng.synchronize()  # the earliest deferred error first, then this value's
            _raise_launch_error(t._handle.poison)
    views, refs = {}, []

    def view(t):
        v = buffer_view(t)
        views[id(v)] = t
        refs.append(_remember(v, t))  # Note [Work results]
        return v

    with torch._C._DisableTorchDispatch():
        h_args = [on_host(a, view) for a in args]
        h_kwargs = {k: on_host(v, view) for k, v in kwargs.items()}
        # The group's neuron backend (gloo) runs it: the op's PrivateUse1 kernel asks the
        # group for the backend of the neuron device, and gloo reads host tensors.
        out = func.redispatch(_NEURON_KEYS, *h_args, **h_kwargs)
    _keep_until_done(out, refs)
    nbytes = _size(func, args, kwargs, size_arg)
    cost = collective_us(eng.spec, pattern, nbytes, _world(args, kwargs))
    launch = eng.device.submit(Launch(func._schema.name, None, nbytes, 0.0, kind="collective",
                                      dma_bytes=nbytes, cost_us=cost))
    _pend(eng, launch.end_us, [t._handle.buffer for t in tensors], out)
    eng.metrics.collectives += 1
    eng.metrics.collective_bytes += nbytes
    # c10d ops return the tensors they were given (in place): the caller's neuron tensors.
    return tree_map(lambda v: views.get(id(v), v) if isinstance(v, torch.Tensor) else v, out)


# Note [Gloo's thread and the GIL]: gloo holds the host views of a collective (tensors made
# in Python) in its Work, and drops them on its own worker thread, which takes the GIL to
# release their Python objects. If that drop is the last reference, and the main thread is
# at that moment destroying the process group (a DDP model's Reducer freed, holding the GIL
# while it joins gloo's threads), the two wait for each other forever. So we hold each Work
# until it was seen completed at an earlier collective: gloo's thread has let go of it by
# then, and the last reference is always ours, dropped on a Python thread. (gloo's thread
# marks a Work completed before it lets go of it: a Work dropped at the look that first saw
# it completed hung a torchrun DDP run at exit, 1 run in 8.)
# Holding the Work must not hold the user's tensors (Note [Work results] maps its views to
# them): once a Work is completed (gloo is done with the bytes) and nothing but us holds its
# Python object (so `result()` can no longer be asked of it), its views are unmapped, and a
# dropped tensor's memory is freed as on CUDA. That release is looked for at each
# collective's issue, each `Work.wait()`, each sync (`torch.neuron.synchronize()`, a read)
# and `destroy_process_group()`; without it the tensors stayed allocated until the
# process's second collective after them, and for good after the last one.
_WORKS: list[list] = []  # [work, completed at the last collective, its views' weakrefs,
#                           the thread that issued it until that thread's next look]
_WORKS_LOCK = threading.Lock()


def _keep_until_done(out, views) -> None:
    global _WORKS
    _release()  # before the new Work: its caller has not been handed it yet
    with _WORKS_LOCK:
        done = [e for e in _WORKS if e[1]]  # completed at an earlier look: ours to drop now
        kept = [e for e in _WORKS if not e[1]]
        for entry in kept:
            entry[1] = entry[0].is_completed()
        _WORKS = kept + [[dist.Work.unbox(w), False, views, threading.get_ident()]
                         for w in tree_flatten(out)[0]
                         if isinstance(w, torch.ScriptObject) and "c10d.Work" in str(w._type())]
    del done  # outside the lock: freeing them may free device memory


def _release() -> None:
    """Unmap the views of the held Works that are completed and held by us alone, so that
    they no longer hold the user's tensors (Note [Gloo's thread and the GIL])."""
    freed, me = [], threading.get_ident()
    with _WORKS_LOCK:
        for entry in _WORKS:
            if entry[3] is not None:  # issued: not released before its caller had it
                if entry[3] != me:
                    continue
                entry[3] = None
            # the refs to the Work's Python object: this list's and getrefcount's own
            # (gloo marks it completed after its future's callbacks ran: they mapped)
            if entry[2] and sys.getrefcount(entry[0]) <= 2 and entry[0].is_completed():
                for ref in entry[2]:
                    v = ref()
                    mapped = _DEVICE_OF.get(id(v)) if v is not None else None
                    if mapped is not None and mapped[0] is ref:
                        freed.append(_DEVICE_OF.pop(id(v)))
                entry[2] = []
    del freed  # outside the lock: the tensors the user dropped are freed here


def _release_works_at_destroy() -> None:
    """The held Works of the collectives before `destroy_process_group()` no longer hold
    their tensors after it (Note [Gloo's thread and the GIL])."""
    import torch.distributed.distributed_c10d as c10d
    destroy = c10d.destroy_process_group
    if patches.is_patched(c10d, "destroy_process_group"):
        return

    def destroy_process_group(group=None):
        _release()
        try:
            return destroy(group)
        finally:
            _release()
    for owner in (c10d, dist):
        patches.patch(owner, "destroy_process_group", destroy_process_group,
                      rests_on="torch.distributed.destroy_process_group: no hook tells when a "
                               "group is destroyed (Note [Gloo's thread and the GIL])")


def _size(func, args, kwargs, name) -> int:
    if name is None:
        return 0
    names = [a.name for a in func._schema.arguments]
    i = names.index(name)
    v = args[i] if i < len(args) else kwargs[name]
    return sum(t.numel() * t.element_size() for t in tree_flatten(v)[0]
               if isinstance(t, torch.Tensor))


def _world(args, kwargs) -> int:
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.ScriptObject) and "c10d.ProcessGroup" in str(v._type()):
            return dist.ProcessGroup.unbox(v).size()
    return 1


# -- functional collectives (DTensor, tensor parallel) ---------------------------------------
# Note [Functional collectives]: `_c10d_functional::*` ops return new tensors and are waited
# on with `wait_tensor`. Their own kernel (CompositeExplicitAutograd, in C++) would call the
# group's backend for the device of what it is handed, so on neuron they are composed here
# from the in-place c10d ops above, on neuron tensors: each collective inside is a device
# op as any other (a boundary, costed, counted). They complete before they return (gloo
# waits), so `wait_tensor` has nothing left to wait for.
_REDUCE_OPS = {"sum": "SUM", "product": "PRODUCT", "min": "MIN", "max": "MAX",
               "band": "BAND", "bor": "BOR", "bxor": "BXOR"}


# The single-tensor forms (the *_into_tensor / *_tensor names are deprecated where these exist)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _group(name):
    if isinstance(name, dist.ProcessGroup):
        return name
    return dist.distributed_c10d._resolve_process_group(name)


def _all_reduce_into(t, reduce_op: str, pg) -> None:
    op = reduce_op.lower()
    if op == "avg":  # gloo has no AVG: a sum, then a division (as DTensor's Partial("avg"))
        dist.all_reduce(t, dist.ReduceOp.SUM, group=pg)
        t.div_(pg.size())
    elif op in _REDUCE_OPS:
        dist.all_reduce(t, getattr(dist.ReduceOp, _REDUCE_OPS[op]), group=pg)
    else:
        raise ValueError(f"all_reduce on neuron: unsupported reduce_op {reduce_op!r}; "
                         f"use one of {sorted(_REDUCE_OPS) + ['avg']}")


def _f_all_reduce(input, reduce_op, group_name):
    out = input.clone(memory_format=torch.contiguous_format)
    _all_reduce_into(out, reduce_op, _group(group_name))
    return out


def _f_all_reduce_(input, reduce_op, group_name):
    _all_reduce_into(input, reduce_op, _group(group_name))
    return input


def _f_all_reduce_coalesced(inputs, reduce_op, group_name):
    return [_f_all_reduce(x, reduce_op, group_name) for x in inputs]


def _f_all_gather_into_tensor(input, group_size, group_name, out=None):
    if out is None:
        out = input.new_empty((input.shape[0] * group_size,) + tuple(input.shape[1:]))
    _all_gather_single(out, input.contiguous(), group=_group(group_name))
    return out


def _f_all_gather_into_tensor_coalesced(inputs, group_size, group_name):
    return [_f_all_gather_into_tensor(x, group_size, group_name) for x in inputs]


def _f_reduce_scatter_tensor(input, reduce_op, group_size, group_name, out=None):
    pg = _group(group_name)
    op = reduce_op.lower()
    if out is None:
        out = input.new_empty((input.shape[0] // group_size,) + tuple(input.shape[1:]))
    red = dist.ReduceOp.SUM if op == "avg" else getattr(dist.ReduceOp, _REDUCE_OPS[op])
    _reduce_scatter_single(out, input.contiguous(), red, group=pg)
    if op == "avg":
        out.div_(pg.size())
    return out


def _f_reduce_scatter_tensor_coalesced(inputs, reduce_op, group_size, group_name):
    return [_f_reduce_scatter_tensor(x, reduce_op, group_size, group_name) for x in inputs]


def _f_all_to_all_single(input, output_split_sizes, input_split_sizes, group_name):
    rows = sum(output_split_sizes) if output_split_sizes else input.shape[0]
    out = input.new_empty((rows,) + tuple(input.shape[1:]))
    dist.all_to_all_single(out, input.contiguous(), list(output_split_sizes) or None,
                           list(input_split_sizes) or None, group=_group(group_name))
    return out


def _f_broadcast(input, src, group_name):
    out = input.clone(memory_format=torch.contiguous_format)
    return _f_broadcast_(out, src, group_name)


def _f_broadcast_(input, src, group_name):
    pg = _group(group_name)
    dist.broadcast(input, dist.get_global_rank(pg, src), group=pg)
    return input


def _f_wait_tensor(tensor):
    return tensor


_FUNCTIONAL = {
    "all_reduce": _f_all_reduce, "all_reduce_": _f_all_reduce_,
    "all_reduce_coalesced": _f_all_reduce_coalesced,
    "all_gather_into_tensor": _f_all_gather_into_tensor,
    "all_gather_into_tensor_out": _f_all_gather_into_tensor,
    "all_gather_into_tensor_coalesced": _f_all_gather_into_tensor_coalesced,
    "reduce_scatter_tensor": _f_reduce_scatter_tensor,
    "reduce_scatter_tensor_out": _f_reduce_scatter_tensor,
    "reduce_scatter_tensor_coalesced": _f_reduce_scatter_tensor_coalesced,
    "all_to_all_single": _f_all_to_all_single,
    "broadcast": _f_broadcast, "broadcast_": _f_broadcast_,
    "wait_tensor": _f_wait_tensor,
}


def _functional(impl):
    def run(eng, func, args, kwargs):
        return impl(*args, **kwargs)
    return run


# FSDP2's own copy ops (fsdp::all_gather_copy_in, split_with_sizes_copy, chunk_cat) have
# Python kernels for CPU and CUDA made of plain ATen ops: on neuron the same kernel runs, its
# ops reaching the engine one by one (no fallback).
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _python_kernel(eng, func, args, kwargs):
    return func.redispatch(_CPU_KEYS, *args, **kwargs)


def _register_functional() -> None:
    import torch.distributed._functional_collectives  # noqa: F401  (defines the ops)
    ns = torch.ops._c10d_functional
    for name, impl in _FUNCTIONAL.items():
        if hasattr(ns, name):
            packet = getattr(ns, name)
            for overload in packet.overloads():
                handlers.handle(getattr(packet, overload), _functional(impl))
    # DTensor wraps a collective's result for autograd with this Python custom op: its own
    # function runs (it wraps the neuron tensor in an AsyncCollectiveTensor).
    from torch._library.custom_ops import _maybe_get_opdef
    wrap = getattr(ns, "_wrap_tensor_autograd", None)
    opdef = _maybe_get_opdef(wrap.default) if wrap is not None else None
    if opdef is not None:
        handlers.handle(wrap.default, _functional(opdef._init_fn))
    try:
        import torch.distributed.fsdp  # noqa: F401  (defines fsdp::*)
    except ImportError:
        return
    for name in ("all_gather_copy_in", "split_with_sizes_copy", "chunk_cat"):
        if hasattr(torch.ops.fsdp, name):
            packet = getattr(torch.ops.fsdp, name)
            for overload in packet.overloads():
                handlers.handle(getattr(packet, overload), _python_kernel)


# -- pipelines (torch.distributed.pipelining) ------------------------------------------------
# Note [Pipeline stages from pipeline()]: `pipe.build_stage(i, device)` moves the stage's
# exported module with `submod.to(device)`. Its parameters are the user's, and the export's
# FakeTensorMode (kept alive by the graph's node.meta["val"]) remembers each one in a
# WeakIdKeyDictionary (MetaTensorDescriber.lookup_tensor: tensor -> the id it described it
# as). Module.to keeps a parameter's identity on neuron by swapping (Note [Module.to keeps
# Parameters] in engine/tensor.py), and torch.utils.swap_tensors refuses a tensor with weakrefs
# ("Couldn't swap InterpreterModule.weight"). Those entries are a cache of a finished trace:
# before the stage moves to neuron, they are dropped (a later conversion of the tensor by
# that mode describes it anew, as for any tensor it has not seen), then torch's move runs.


def _forget_traced(module) -> None:
    from torch._subclasses.fake_tensor import FakeTensor
    modes = {}
    for m in module.modules():
        for node in getattr(getattr(m, "graph", None), "nodes", ()):
            val = node.meta.get("val")
            if isinstance(val, FakeTensor):
                modes[id(val.fake_mode)] = val.fake_mode
    tensors = list(module.parameters()) + list(module.buffers())
    for mode in modes.values():
        describer = mode.fake_tensor_converter.meta_converter.describer
        for t in tensors:
            describer.lookup_tensor.pop(t, None)


def _patch_pipeline_stage(stage_module) -> None:
    cls = stage_module._PipelineStage
    move = cls._move_submod_to_device
    if patches.is_patched(cls, "_move_submod_to_device"):
        return

    def _move_submod_to_device(self):
        if torch.device(self.device).type == DEVICE_TYPE:  # Note [Pipeline stages from pipeline()]
            _forget_traced(self.submod)
        return move(self)
    patches.patch(cls, "_move_submod_to_device", _move_submod_to_device,
                  rests_on="torch.distributed.pipelining's _PipelineStage._move_submod_to_device "
                           "(private)")


# -- asynchronous checkpoints (torch.distributed.checkpoint.async_save) -----------------------
# Note [Staging neuron tensors]: async_save first stages the state dict into host memory
# (StateDictStager._offload_tensor), storage by storage: `type(storage)(n, device="cpu")`,
# then `cpu_storage.copy_(storage)`, then the tensor's `__dict__` copied onto the CPU copy.
# A neuron tensor's storage is a NeuronStorage (no C++ storage: UntypedStorage.copy_ cannot
# read it) and its `__dict__` holds the engine's handle. So a neuron tensor is staged as
# its `.cpu()` (the device-to-host copy CUDA's staging makes, a sync point), carrying only
# the user's attributes (serialization.user_state); every other tensor is staged by torch.


def _patch_stager(stager_module) -> None:
    cls = stager_module.StateDictStager
    offload = cls._offload_tensor
    if patches.is_patched(cls, "_offload_tensor"):
        return

    def _offload_tensor(self, x, memo, non_blocking=False):
        if not isinstance(x, NeuronTensor):
            return offload(self, x, memo, non_blocking=non_blocking)
        from ..engine.serialization import user_state
        y = memo[id(x)] = x.detach().cpu()  # Note [Staging neuron tensors]
        for name, value in user_state(x).items():
            setattr(y, name, self.deepcopy_with_tensor_offload(value, memo,
                                                                non_blocking=non_blocking))
        return y
    patches.patch(cls, "_offload_tensor", _offload_tensor,
                  rests_on="torch.distributed.checkpoint's StateDictStager._offload_tensor "
                           "(private)")
