"""Ops that need data now: CPU fallback (ops the device does not implement: sync, copy in,
run on the host, copy back, counted and warned once per op) and ops whose output shapes only
execution can tell (a device launch the host waits for)."""
from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from device import Launch, LaunchError
from fusion.ir import Handle, extent_bytes, written_arguments, written_values
from fusion.ops import RANDOM, device_kernel, linalg_flops, op_class
from fusion.host import cpu_kernels

from .. import config as _config
from .tensor import NeuronTensor
from ..errors import (COPIED, NeuronFallbackError, _nested_error, _quantized_error,
                      _raise_launch_error, _sparse_error, refuse_copied_view, user_error)
from .results import resize_out
from .source import _source, _user_stacklevel
from .templates import foreign_tensor
from .transfer import buffer_view, on_host


# Outputs PyTorch makes on the host whatever the device (from a CPU argument's options):
# a PackedSequence's batch_sizes and the lengths pad_packed_sequence returns, as on CUDA.
_HOST_OUTPUTS = {"aten::_pack_padded_sequence": (1,), "aten::_pad_packed_sequence": (1,)}


# Arguments CUDA's kernels take on the host: a PackedSequence's lengths and batch sizes.
_HOST_ARGS = frozenset({"lengths", "batch_sizes"})


def _check_devices(eng, func, args, kwargs) -> None:
    """CUDA's rule for an op's tensors: one device, except 0-d CPU tensors and `_HOST_ARGS`
    (`torch.equal(neuron_t, cpu_t)` ran on the host and said True)."""
    names = [a.name for a in func._schema.arguments]
    written = written_arguments(func)[1]
    for name, v in list(zip(names, args)) + list(kwargs.items()):
        if name in _HOST_ARGS:
            continue
        for t in tree_flatten(v)[0]:
            if (isinstance(t, torch.Tensor) and type(t) is not NeuronTensor
                    and (t.dim() or name in written)):  # a 0-d host value, never a target
                raise foreign_tensor(eng, t, func)


def run_now(eng, func, args, kwargs, fallback: bool):
    """Ops that need data now: CPU fallback (sync, copy in, run, copy back) or output
    shapes only execution can tell (a device launch the host waits for)."""
    name = func._schema.name
    cfg = _config.config
    _check_devices(eng, func, args, kwargs)
    if COPIED[0]:  # Note [Copied views] in errors.py
        refuse_copied_view([t._handle for t in written_values(func, args, kwargs)
                            if type(t) is NeuronTensor])
    if fallback:
        if not cfg.fallback_enabled:
            raise NeuronFallbackError(
                f"Operator '{name}' has no Neuron implementation and CPU fallback is off "
                f"(NEURON_FALLBACK_ENABLED=0); unset it to run the op on CPU.")
        if name not in eng.warned:
            eng.warned.add(name)
            warnings.warn(f"Operator '{name}' fell back to CPU", UserWarning,
                          stacklevel=_user_stacklevel())
        eng.metrics.cpu_fallbacks[name] += 1
    eng.sync(("fallback:" if fallback else "data-dependent:") + name)
    views, host = {}, {}

    def view(v):  # one host view per tensor object: CPU kernels test identity (q is k is v)
        if id(v) not in host:
            views[id(v)] = v
            host[id(v)] = buffer_view(v)
        return host[id(v)]

    with torch._C._DisableTorchDispatch(), cpu_kernels():  # Note [CPU kernels inside dispatch]
        c_args = [on_host(a, view) for a in args]
        c_kwargs = {k: on_host(v, view) for k, v in kwargs.items()}
        for v in views.values():  # Note [Poison] in fusion/program.py: as a host read
            if v._handle.poison is not None:
                _raise_launch_error(v._handle.poison)
        nbytes_in = sum(v.numel() * v.element_size() for v in views.values())
        result = {}

        random = op_class(func) == RANDOM and c_kwargs.get("generator") is None
        kernel = device_kernel(func)

        def work():
            try:  # a random op draws from the device's stream, as queued ones do
                result["out"] = (eng.device.rng.run(func, c_args, c_kwargs) if random
                                 else kernel(*c_args, **c_kwargs))
            except Exception as e:
                if not fallback:  # a device launch: the op's error, found at the sync
                    result["error"] = e
                    raise LaunchError(e) from None
                raise

        if fallback:
            eng.device.submit(Launch("d2h", None, nbytes_in, 0, kind="dma",
                                      dma_bytes=nbytes_in))
            eng.metrics.d2h_bytes += nbytes_in
            work()
            eng.device.advance_host(eng.spec.host_op_overhead_us)
        else:
            flops = linalg_flops(func, c_args, c_kwargs)  # (a barrier's: eigh, svd...)
            eng.device.submit(Launch(name, work, nbytes_in, flops or 0.0,
                                      context=[_FakeNode(func)]))
            try:
                eng.synchronize()
            except Exception:
                # The host waits for this op (the queue was synced before it): its own error
                # is raised at the call as CPU raises it (unique(dim=3)'s IndexError), not as
                # a NeuronRuntimeError.
                e = result.get("error")
                if e is None:
                    raise
                raise user_error(e) from None
        out = result["out"]
    outs = _resized_outs(eng, func, args, kwargs, c_args, c_kwargs)
    # Outputs: tensors sharing an argument's storage stay views of its buffer.
    by_storage = {}
    for v in views.values():
        if v._handle.buffer is not None:
            by_storage[v._handle.buffer.storage.data_ptr()] = v
    leaves, spec = tree_flatten(out)
    new_leaves = []
    host = _HOST_OUTPUTS.get(name, ())
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or i in host:
            new_leaves.append(leaf)
            continue
        if id(leaf) in outs:  # an out= argument, handed back
            new_leaves.append(outs[id(leaf)])
            continue
        if leaf.is_nested:
            raise _nested_error(name)
        if leaf.layout != torch.strided:
            raise _sparse_error(name, leaf.layout)
        if leaf.is_quantized:
            raise _quantized_error(name)
        if leaf.is_conj() or leaf.is_neg():  # a lazy view (`solve(left=False)`'s): its
            with torch._C._DisableTorchDispatch():  # storage holds the unconjugated values
                leaf = leaf.resolve_conj().resolve_neg()
        owner = by_storage.get(leaf.untyped_storage().data_ptr()) if leaf.numel() else None
        if owner is not None:
            same = next((v for v in views.values() if v._handle is owner._handle
                         and v.shape == leaf.shape and v.stride() == leaf.stride()
                         and v.storage_offset() == leaf.storage_offset()
                         and v.dtype == leaf.dtype), None)  # (`prims.real` of a 0-d complex
            # tensor: its float view has the tensor's layout, not its dtype)
            new_leaves.append(same if same is not None else eng.wrap(
                owner._handle, tuple(leaf.shape), leaf.stride(), leaf.storage_offset(),
                leaf.dtype))
            continue
        # CPU's layout is kept (nonzero's (1, N) strides decide view-vs-copy later).
        n = extent_bytes(leaf.shape, leaf.stride(), 0, leaf.element_size())
        eng.make_room(n)
        with torch._C._DisableTorchDispatch():
            st = leaf.untyped_storage()
            if leaf.storage_offset() or st.nbytes() != n:
                st = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device="cpu")
                st = st.copy_(leaf).untyped_storage()
        h = Handle(n, eng.device.alloc(n, st))
        if fallback:
            eng.device.submit(Launch("h2d", None, n, 0, kind="dma", dma_bytes=n))
            eng.metrics.h2d_bytes += n
        new_leaves.append(eng.wrap(h, tuple(leaf.shape), leaf.stride(), 0, leaf.dtype))
    return tree_unflatten(new_leaves, spec)


def _resized_outs(eng, func, args, kwargs, c_args, c_kwargs) -> dict:
    """Written arguments of an op run on the host (out= ones and in-place selves), by the id
    of their host view: one the host kernel resized (`torch.nonzero(x, out=torch.empty(0))`,
    a CPU fallback into an out of the wrong shape, `addbmm_` of a (1,) self, which CPU
    resizes to the result's shape) is resized the same way on the device and given the
    host's values (before, the device tensor kept its old shape and values)."""
    outs = {}
    for j, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        if a.name in kwargs:
            v, hv = kwargs[a.name], c_kwargs[a.name]
        elif j < len(args) and not a.kwarg_only:
            v, hv = args[j], c_args[j]
        else:
            continue
        for v, hv in zip(tree_flatten(v)[0], tree_flatten(hv)[0]):
            if type(v) is not NeuronTensor or not isinstance(hv, torch.Tensor):
                continue
            outs[id(hv)] = v
            if (hv.shape, hv.stride(), hv.storage_offset()) == (
                    v.shape, v.stride(), v.storage_offset()) and v._handle.buffer is not None \
                    and hv.untyped_storage().data_ptr() \
                    == v._handle.buffer.storage.data_ptr():
                continue  # written in place
            resize_out(eng, v, tuple(hv.shape), hv.stride())
            with torch._C._DisableTorchDispatch():
                buffer_view(v).copy_(hv)
    return outs


class _FakeNode:
    def __init__(self, func):
        self.func = func
        self.source = _source()
