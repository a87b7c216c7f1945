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
the values are not to be read before it (as on CUDA). Functional collectives
(`_c10d_functional::*`, used by DTensor) are not handled here: they still fall back.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

from device import Launch
from device.interconnect import BARRIER, P2P, RING_ALL_REDUCE, RING_GATHER, TREE, collective_us

from . import _engine

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
    for name in _COLLECTIVES:
        packet = getattr(torch.ops.c10d, name)
        for overload in packet.overloads():
            _engine._SPECIAL[getattr(packet, overload)] = collective
    _done = True


def collective(eng, func, args, kwargs):
    """One c10d op on neuron tensors: a boundary, then gloo over the device buffers, then a
    costed collective launch (Note [Collectives]). Runs under the engine lock."""
    eng.metrics.ops += 1
    eng.device.host_us += eng.spec.host_op_overhead_us
    eng.flush("collective")
    pattern, size_arg = _COLLECTIVES[func._schema.name.split("::")[1]]
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, _engine.NeuronTensor)]
    for t in tensors:
        if t._handle.poison is not None:  # Note [Poison] in fusion/program.py: as a read,
            eng.synchronize()  # the earliest deferred error first, then this value's
            raise _engine._runtime_error(t._handle.poison) from t._handle.poison.error
    views = {}

    def view(t):
        v = _engine._buffer_view(t)
        views[id(v)] = t
        return v

    with torch._C._DisableTorchDispatch():
        h_args = [_engine._on_host(a, view) for a in args]
        h_kwargs = {k: _engine._on_host(v, view) for k, v in kwargs.items()}
        # The group's neuron backend (gloo) runs it: the op's PrivateUse1 kernel asks the
        # group for the backend of the neuron device, and gloo reads host tensors.
        out = func.redispatch(_NEURON_KEYS, *h_args, **h_kwargs)
    nbytes = _size(func, args, kwargs, size_arg)
    cost = collective_us(eng.spec, pattern, nbytes, _world(args, kwargs))
    eng.device.submit(Launch(func._schema.name, None, nbytes, 0.0, kind="collective",
                             dma_bytes=nbytes, cost_us=cost))
    eng.metrics.collectives += 1
    eng.metrics.collective_bytes += nbytes
    # c10d ops return the tensors they were given (in place): the caller's neuron tensors.
    return tree_map(lambda v: views.get(id(v), v) if isinstance(v, torch.Tensor) else v, out)


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
