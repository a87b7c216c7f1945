"""Registers `neuron` into PyTorch from pure Python (PrivateUse1, renamed)."""
from __future__ import annotations

import contextlib
import functools
import importlib

import torch

from fusion import substitute as _substitute
from fusion import host
from fusion.ir import extent_bytes
from ..engine.tensor import NeuronTensor, _refuse_sharing, install_set_data
from ..config import DEVICE_TYPE
from . import native as _native, attention, autocast, compile, distributed, frameworks, lightning, linalg, neuron, pinned, profiler, rnn  # noqa: F401,E501
from .. import errors, patches
from ..engine import engine as _engine, storage as _storage, cpu_settings, handlers, hooks, results, serialization, transfer

_done = False
_lib = None


def register() -> None:
    """Idempotent. Fails clearly when PrivateUse1 already belongs to another backend."""
    global _done, _lib
    if _done:
        return
    name = torch._C._get_privateuse1_backend_name()
    if name != "privateuseone":
        raise RuntimeError(
            f"Cannot register the 'neuron' device: PyTorch's PrivateUse1 slot already belongs "
            f"to the backend '{name}' (only one out-of-tree backend can be loaded per "
            f"process). Do not import both; set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to stop "
            f"backends from loading on `import torch`.")
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
    native = _install_native()  # before PyTorch's Python guard and hooks (Note [Native hooks])
    _setup_privateuseone_for_python_backend("neuron", backend_module=neuron)
    handlers.handle(torch.ops.aten.record_stream.default, neuron.record_stream)
    _lib = torch.library.Library("aten", "IMPL")
    # Kernels below the Python key: entries into the engine, under its lock (Note [Threads])
    kernels = {"empty.memory_format": _empty, "empty_strided": _empty_strided,
               "_copy_from": _copy_from, "_efficientzerotensor": _efficientzerotensor,
               "as_strided": _as_strided,
               # FSDP1 calls it under no_dispatch(), past the Python key
               "record_stream": lambda t, s: neuron.record_stream(None, None, (t, s), {}),
               **{op: _host_factory(op) for op in _HOST_FACTORIES}}
    for name, kernel in kernels.items():
        _lib.impl(name, _engine.entry(kernel), "PrivateUse1")
    autocast.register(_LIBS)  # torch.autocast(device_type="neuron"): CUDA's policy
    _register_fused_rnn_cells()
    # Note [Substitution]: the kernel library is imported when a flush first looks for it
    _substitute.LOADER = lambda: importlib.import_module("adaptive_eager.integration.kernels")
    _register_undecomposed()
    _wrap_backward()
    from multiprocessing.reduction import ForkingPickler
    ForkingPickler.register(NeuronTensor, _refuse_sharing)  # Note [Sharing across processes]
    hooks.install()  # Note [Hooks that raise]
    _route_accelerator_api()
    _cpu_picks_for_chunked_cross_entropy()
    _storage.refuse_device_storages()
    install_set_data()  # Note [Setting .data across devices]
    _refuse_other_layouts()
    cpu_settings.install(lambda: _engine.flush_all("settings"))  # Note [CPU settings]
    if not native:
        pinned.register()  # the Python path for pinned memory (the native hooks have PyTorch's)
    serialization.register()  # torch.save / torch.load / deepcopy (Note [Checkpoints])
    profiler.install()  # torch.profiler shows the device's launches, compiles, syncs
    compile.install()  # torch.compile(backend="neuron"), once torch._dynamo is imported
    distributed.register()
    lightning.install()  # Trainer(accelerator="neuron") once Lightning is imported
    frameworks.install()  # Note [Frameworks find the device]: `torch_neuronx`, if absent
    _done = True


def _install_native() -> bool:
    """Note [Native hooks] in native.py: the C++ device guard and hooks, if they can be had;
    then the current core is theirs (per thread) and neuron generators draw through them."""
    def sync(k):
        _engine.core(k).sync("synchronize")

    def rng(k):  # a core's default generator is its device RNG: queued draws first
        return _engine.core(k).with_rng(_gen)

    if not _native.install(neuron.device_count(), sync, rng):
        return False
    mod = _native.module()
    _engine.use_native_current(mod.current_device, lambda k: mod.set_device(k, neuron.device_count()))
    transfer.use_cpu_generator(_cpu_generator)
    neuron.use_native(mod, neuron.device_count())
    host.use_native_host_call(mod.host_call)  # Note [Host calls] in fusion/host.py
    return True


def _cpu_generator(g):
    """The CPU generator that draws a neuron generator's numbers (a core's default one: its
    device RNG, whose queued draws run first)."""
    k, default, own = _native.module().generator_info(g)
    if not default:
        return own
    return _engine.core(k).with_rng(_gen)


def _gen(rng):
    return rng.gen


def _refuse_other_layouts() -> None:
    """Quantized and sparse neuron tensors have no kernels: PyTorch reached a missing one deep
    inside (`Could not run 'aten::empty_quantized' with arguments from the 'Quantizedneuron'
    backend`), or made a sparse CSR tensor on neuron whose ops then failed with a two-devices
    error naming neuron:0 twice. Every op of those dispatch keys is refused, clearly."""
    lib = torch.library.Library("_", "IMPL")

    def quantized(op, *args, **kwargs):
        raise errors._quantized_error(op._schema.name)

    def sparse(op, *args, **kwargs):
        layout = next((a.layout for a in args if isinstance(a, torch.Tensor)
                       and a.layout != torch.strided), kwargs.get("layout"))
        raise errors._sparse_error(op._schema.name, layout)

    lib.fallback(quantized, "QuantizedPrivateUse1")
    lib.fallback(sparse, "SparsePrivateUse1")
    lib.fallback(sparse, "SparseCsrPrivateUse1")
    _LIBS.append(lib)


def _check_grad_devices(outputs, grads) -> None:
    """CUDA's check of the gradients a backward starts from (autograd's validate_outputs,
    which skips tensor subclasses): one on another device is refused unless it is 0-d. A CPU
    gradient for a neuron output otherwise left `.grad` on the CPU; a neuron gradient for a
    CPU output failed an internal assert of autograd's stream bookkeeping."""
    for i, (out, g) in enumerate(zip(outputs, grads)):
        if isinstance(g, torch.Tensor) and g.dim() and g.device != out.device and (
                type(out) is NeuronTensor or type(g) is NeuronTensor):
            raise RuntimeError(f"invalid gradient at index {i} - expected device {out.device} "
                               f"but got {g.device}")


def _wrap_backward() -> None:
    """Errors raised by neuron ops on autograd's device thread are handed over (Note
    [Device-thread errors] in hooks.py) and re-raised here, on the caller's thread, as the
    original exception. Wraps the one private function both backward() and grad() call."""
    import torch.autograd
    import torch.autograd.graph as graph
    run = graph._engine_run_backward
    if patches.is_patched(graph, "_engine_run_backward"):
        return

    def _engine_run_backward(outputs, grads, *args, **kwargs):
        _check_grad_devices(outputs, grads)
        # A neuron backward runs on the caller's thread, as CPU's does: autograd orders the
        # nodes a double backward creates by a per-thread sequence number, so on its device
        # thread gradients were summed in another order than on CPU (ulps off). And Note
        # [Cores] in neuron.py: once another core is used, autograd's device threads fail.
        # (By device, not type: torch.func's grad hands in its wrappers of neuron tensors.)
        neuron = _engine.other_cores_used() or any(
            isinstance(o, torch.Tensor) and o.device.type == DEVICE_TYPE for o in outputs)
        threads = (torch.autograd.set_multithreading_enabled(False) if neuron
                   else contextlib.nullcontext())
        try:
            with threads:
                result = run(outputs, grads, *args, **kwargs)
        except (RuntimeError, TypeError):  # the C++ refusal of a handed-over error
            err = hooks.take_handoff()
            if err is None:
                raise
            raise err.with_traceback(None) from None
        err = hooks.take_handoff()  # an op returning nothing swallows the refusal
        if err is not None:
            raise err.with_traceback(None)
        return result

    for owner in (graph, torch.autograd):  # one function, re-exported
        patches.patch(owner, "_engine_run_backward", _engine_run_backward,
                      rests_on="torch.autograd.graph._engine_run_backward (private), which "
                               "backward() and grad() both call")


# torch.accelerator, the device-generic API, syncs and reads memory through the C++ device
# guard and allocator, which a Python backend cannot provide (PyTorch raises "Backend doesn't
# support synchronizing" and an internal assert): for neuron, these go to torch.neuron's own.
def _route_accelerator_api():
    import torch.accelerator.memory as memory
    from torch.accelerator._utils import _get_device_index

    def route(module, name, ours, takes_device=True):
        original = getattr(module, name)

        @functools.wraps(original)
        def call(*args, **kwargs):
            acc = torch.accelerator.current_accelerator()
            if acc is None or acc.type != DEVICE_TYPE:
                return original(*args, **kwargs)
            if not takes_device:
                return ours()
            device = args[0] if args else next(iter(kwargs.values()), None)
            if device is None or isinstance(device, (str, torch.device)) \
                    and torch.device(device).index is None:
                return ours(None)  # the current core, ours (PyTorch asks the C++ guard: 0)
            return ours(_get_device_index(device, optional=True))
        for mod in (module, torch.accelerator):  # the name is re-exported there too
            if getattr(mod, name, None) is original:
                patches.patch(mod, name, call, rests_on="torch.accelerator's C++ device guard "
                                                        "and allocator, which we lack")

    route(torch.accelerator, "synchronize", neuron.synchronize)
    route(memory, "memory_stats", neuron.memory_stats)  # memory_allocated & co. read it
    route(memory, "reset_peak_memory_stats", neuron.reset_peak_memory_stats)
    route(memory, "get_memory_info", neuron.mem_get_info)
    route(memory, "empty_cache", neuron.empty_cache, takes_device=False)
    for name in ("set_device_index", "set_device_idx"):
        route(torch.accelerator, name, neuron.set_device)
    for name in ("current_device_index", "current_device_idx"):
        route(torch.accelerator, name, neuron.current_device, takes_device=False)
    route(torch.accelerator, "device_index", neuron.device)  # a context manager
    route(torch.accelerator, "current_stream", neuron.current_stream)  # Note [Streams]
    set_stream = torch.accelerator.set_stream

    @functools.wraps(set_stream)
    def set_neuron_stream(stream):
        if isinstance(stream, torch.Stream) and stream.device.type == DEVICE_TYPE:
            return neuron.set_stream(stream)
        return set_stream(stream)
    patches.patch(torch.accelerator, "set_stream", set_neuron_stream,
                  rests_on="torch.accelerator.set_stream's C++ stream guard, which we lack")


# F.linear_cross_entropy's chunked path picks its accumulation policy, chunking and
# accumulation dtype by the input's device type (`LinearCrossEntropyOptions._adjust`): float32
# accumulation and the "accurate" policy for float16 / bfloat16 on `cpu` only, so on neuron a
# half-precision loss and its gradients were 1-2 ulps off CPU's. The device runs CPU's kernels:
# it takes CPU's picks.
def _cpu_picks_for_chunked_cross_entropy():
    options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options is None or not hasattr(options, "_adjust"):
        return

    def wrap(adjust):
        @functools.wraps(adjust)
        def cpu_picks(self, num_batches, in_features, num_classes, dtype, device=None):
            if device is not None and torch.device(device).type == DEVICE_TYPE:
                device = torch.device("cpu")
            return adjust(self, num_batches, in_features, num_classes, dtype, device)
        return cpu_picks
    patches.patch(options, "_adjust", wrap=wrap,
                  rests_on="torch.nn.LinearCrossEntropyOptions._adjust (private): its device "
                           "argument only picks the defaults of the \"auto\" settings")


# PyTorch picks CUDA-style fused RNN cells for accelerators (`input.is_privateuseone()`), and
# they have no CPU kernel to fall back to: on neuron they are composed from ops the device has,
# at the Autograd key, so autograd differentiates the composition.
def _lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias + hidden_bias
    i, f, g, o = gates.chunk(4, 1)
    cy = f.sigmoid() * cx + i.sigmoid() * g.tanh()
    hy = o.sigmoid() * cy.tanh()
    return hy, cy, gates  # workspace: the gates, as the fused kernel keeps them


def _gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    if input_bias is not None:
        input_gates, hidden_gates = input_gates + input_bias, hidden_gates + hidden_bias
    ir, ii, in_ = input_gates.chunk(3, 1)
    hr, hi, hn = hidden_gates.chunk(3, 1)
    r, z = (ir + hr).sigmoid(), (ii + hi).sigmoid()
    n = (in_ + r * hn).tanh()
    hy = n + z * (hx - n)
    return hy, torch.cat([r, z, n, hx, hn], 1)  # workspace of the fused kernel's shape


# ATen's dropout runs the fused `native_dropout` on every device but the CPU, whose backward
# multiplies by the mask and a float scale; CPU multiplies by `mask / (1 - p)` rounded to the
# input's dtype: in float16 / bfloat16 the gradients differed by an ulp (every HF model with
# dropout trained in half precision). Neuron composes CPU's `_dropout`, op for op.
def _dropout(input, p, train):
    if p < 0 or p > 1:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p == 0 or not train or input.numel() == 0:
        return input
    if p == 1:
        return input * torch.zeros((), dtype=input.dtype, device=input.device)
    return input * torch.empty_like(input).bernoulli_(1 - p).div_(1 - p)


# one_hot takes a functional path for any tensor with the Python key (ours): `eq` against an
# arange, which lays the result out like the input and gives an all-zero row for a class out
# of range. CPU and CUDA fill a fresh contiguous tensor with scatter_, which raises on a bad
# class: so does neuron, as CUDA does it (a bad class is the scatter's deferred error).
def _one_hot(self, num_classes=-1):
    if self.dtype != torch.int64:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    if self.numel() == 0:
        if num_classes <= 0:
            raise RuntimeError("Can not infer total number of classes from empty tensor.")
        return self.new_empty((*self.shape, num_classes))
    if num_classes == -1:
        num_classes = int(self.max().item()) + 1
    elif num_classes < 1:
        raise RuntimeError("num_classes should be positive")
    out = self.new_zeros((*self.shape, num_classes))
    return out.scatter_(-1, self.unsqueeze(-1), 1)


# Ops with a CPU (and CUDA) kernel that PyTorch decomposes for any other backend
# (CompositeImplicitAutograd): silu's backward in bfloat16 then rounds every intermediate,
# where CPU's and CUDA's kernels compute in float32 and round once. A PrivateUse1 kernel stops
# the decomposition, so the op itself reaches the engine, which runs CPU's kernel. The kernel
# is reached only without the Python key (never for our tensors): the decomposition then.
_NOT_DECOMPOSED = ("silu_backward", "mish_backward", "native_channel_shuffle")


def _register_undecomposed():
    lib = torch.library.Library("aten", "IMPL")
    for name in _NOT_DECOMPOSED:
        op = getattr(torch.ops.aten, name).default
        lib.impl(name, lambda *args, _op=op, **kwargs: _op.decompose(*args, **kwargs),
                 "PrivateUse1")
    _LIBS.append(lib)


def _ctc_loss(log_probs, targets, input_lengths, target_lengths, *args, **kwargs):
    """`F.ctc_loss` with length tensors: PyTorch reads CPU or CUDA tensors' lengths on the host
    and computes a tensor subclass's with ops over the length tensors, which then had to be
    on the device (CPU lengths, which CUDA takes, raised "two devices"): moved there first."""
    device = log_probs.device
    return torch.ops.aten.ctc_loss.Tensor.decompose(
        log_probs, targets, input_lengths.to(device), target_lengths.to(device), *args,
        **kwargs)


def _register_fused_rnn_cells():
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("ctc_loss.Tensor", _ctc_loss, "AutogradPrivateUse1")
    lib.impl("_thnn_fused_lstm_cell", _lstm_cell, "AutogradPrivateUse1")
    lib.impl("_thnn_fused_gru_cell", _gru_cell, "AutogradPrivateUse1")
    lib.impl("one_hot", _one_hot, "AutogradPrivateUse1")
    lib.impl("dropout", _dropout, "AutogradPrivateUse1")
    lib.impl("scaled_dot_product_attention", attention.sdpa, "AutogradPrivateUse1")
    attention.register()  # and in torch.compile's graphs
    lib.impl("lstm.input", rnn.lstm, "AutogradPrivateUse1")
    lib.impl("linalg_svdvals", linalg.svdvals, "AutogradPrivateUse1")
    lib.impl("linalg_eigvalsh", linalg.eigvalsh, "AutogradPrivateUse1")
    for overload in linalg.MATRIX_RANK_OUT:  # (Note [matrix_rank's out=]: CPU's too)
        for key in ("AutogradPrivateUse1", "AutogradCPU"):
            lib.impl(f"linalg_matrix_rank.{overload}", linalg.matrix_rank_out(overload), key)
    for name in ("gru", "rnn_tanh", "rnn_relu"):
        lib.impl(f"{name}.input", getattr(rnn, name), "AutogradPrivateUse1")
    lib.impl("lstm_cell", rnn.lstm_cell, "AutogradPrivateUse1")
    lib.impl("gru_cell", rnn.gru_cell, "AutogradPrivateUse1")
    # Conjugate and negative views are materialized on the device (adaptive_eager/LIMITS.md), so
    # autograd must not take them for views either: it rebased a later in-place change of
    # the base onto them, and `resolve_conj()` (a copy on CPU, the tensor itself here) took
    # its gradient away (fuzzer seed 40003841: a gradient of 0 for CPU's 1)
    # Writes through them are refused (Note [Copied views] in errors.py); `resolve_conj()` /
    # `resolve_neg()` of one is a new tensor, as CPU's resolve of a conj/neg view is.
    lib.impl("_conj", lambda t: errors.copied_view(torch.conj_physical(t)), "AutogradPrivateUse1")
    lib.impl("_neg_view", lambda t: errors.copied_view(torch.neg(t)), "AutogradPrivateUse1")
    for name in ("resolve_conj", "resolve_neg"):
        lib.impl(name, _resolved, "AutogradPrivateUse1")
    _LIBS.append(lib)


_LIBS = []  # every torch.library.Library registered here, kept alive


def _resolved(self):
    if type(self) is not NeuronTensor:  # traced (Note [Copied views]): clone a copied view
        return self.clone() if errors.traced_copy(self) else self
    return self.clone() if self._handle in errors.COPIED_VIEWS else self


def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None,
           memory_format=None):
    size = tuple(int(s) for s in size)
    stride = torch.empty(size, device="meta",
                         memory_format=memory_format or torch.contiguous_format).stride()
    out = neuron._E(device).empty(size, stride, dtype)
    results.fill_uninitialized(out)
    return out


def _empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    out = neuron._E(device).empty(tuple(int(s) for s in size),
                                     tuple(int(s) for s in stride), dtype)
    results.fill_uninitialized(out)
    return out


def _as_strided(self, size, stride, storage_offset=None):
    """as_strided reached below the Python key (our own kernels' helpers under
    `torch.use_deterministic_algorithms(True)`: its fill of new memory, reached by
    index_put_'s deterministic path, had no kernel): a view of the same buffer, checked
    against it as CPU checks."""
    off = self.storage_offset() if storage_offset is None else int(storage_offset)
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if extent_bytes(size, stride, off, self.element_size()) > self._handle.nbytes:
        errors._out_of_bounds(size, stride, off, self.dtype, self._handle.nbytes)
    return NeuronTensor(self._engine, self._handle, size, stride, off, self.dtype)


def _efficientzerotensor(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    """Note [Zero tensors]: autograd's known-zero gradients and tangents (`sgn`, `angle`, forward
    AD...). CPU's is a ZeroTensor: a tensor with the ZeroTensor dispatch key, whose kernels
    skip the arithmetic (`mul` gives a ZeroTensor whatever the other factor, so 0 * inf is 0;
    `add` gives the other operand, so -0.0 stays -0.0), and whose fallback materializes zeros
    for every other op. The device's is zeros in a buffer, given that key by the native hooks
    (the key has no Python setter): ZeroTensor's kernels then run as on CPU, above the
    device's, and the fallback's zeros are the device's own. Without the native hooks it is
    plain zeros (adaptive_eager/LIMITS.md)."""
    t = _empty(size, dtype=dtype, device=device).zero_()
    if _native.loaded():
        _native.module().mark_zero(t)
    return t


def _copy_from(src, dst, non_blocking=False):
    """Reached instead of `copy_` where PyTorch excludes Python dispatch (`torch.tensor(...,
    device="neuron")` builds on the host, then copies). Registered under the engine lock
    (`_engine.entry`): without it, a 0-d `torch.tensor(v, device="neuron")` queued its copy
    while another thread queued or flushed: nodes numbered for another segment, a live value
    left unwritten, another thread's runtime values (wrong results, or an AttributeError)."""
    eng = dst._engine if isinstance(dst, NeuronTensor) else src._engine
    return transfer.copy_(eng, torch.ops.aten.copy_.default, (dst, src, non_blocking), {})


# Factories whose default kernels write through a resizing `out=`, or call a CPU-only kernel
# stub (kaiser_window: an internal assert on any other device): computed on the host and
# copied in (random ones draw from the device generator, so seeds behave as on the device).
_HOST_FACTORIES = ["arange", "arange.start", "arange.start_step", "linspace", "logspace",
                   "eye", "eye.m", "randperm", "randperm.generator", "tril_indices",
                   "triu_indices", "range", "range.step", "kaiser_window",
                   "kaiser_window.periodic", "kaiser_window.beta"]


def cpu_error(op, args, kwargs) -> None:
    """Raise the error CPU's kernel raises for these factory arguments, if it raises one."""
    try:
        op(*args, **dict(kwargs, device=torch.device("cpu")))
    except Exception as e:
        raise e.with_traceback(None) from None


def _host_factory(name):
    packet, _, overload = name.partition(".")
    op = getattr(getattr(torch.ops.aten, packet), overload or "default")
    random = packet == "randperm"

    def impl(*args, **kwargs):
        gen = kwargs.get("generator")  # randperm.generator: kwarg-only
        if gen is not None:
            gen = transfer.on_host(gen, None)  # a neuron generator's CPU one, or the error
        eng = neuron._E(kwargs.get("device"))
        with torch._C._DisableTorchDispatch():
            try:
                meta = op(*args, **dict(kwargs, device=torch.device("meta")))
            except Exception:  # CPU's own words where CPU refuses it too (the meta kernels'
                # lose the "torch." prefix, and logspace's says linspace)
                if not random:  # (a draw would move CPU's generator)
                    cpu_error(op, args, kwargs)
                raise
            out = eng.empty(tuple(meta.shape), meta.stride(), meta.dtype)  # the device's
            kwargs = dict(kwargs, device=torch.device("cpu"))  # out-of-memory error first
            if random and gen is not None:
                eng.flush("rng")
                cpu = op(*args, **dict(kwargs, generator=gen))
            elif random:
                eng.flush("rng")
                cpu = eng.device.rng.run(op, args, kwargs)
            else:
                cpu = op(*args, **kwargs)
            eng.metrics.ops += 1
            eng.write(out, cpu)
            return out

    return impl
