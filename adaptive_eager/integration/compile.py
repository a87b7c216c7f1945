"""`torch.compile(model, backend="neuron")`: the third mode.

Dynamo captures FX graphs and AOTAutograd splits them into forward, backward and inference
graphs; each graph, when it runs, is recorded into the engine whole, with no cut inside it
(`one_segment`), so the shared partitioner and executable cache turn it into whole-graph
executables: in eager mode it is flushed once (reason "compile graph"), in adaptive mode it
joins the surrounding queue. Code between graphs (graph breaks) runs in the current eager or
adaptive mode. A mode is a flush policy plus where segments come from, never a second engine.

Note [Dynamo and the neuron tensor]: a neuron tensor is a wrapper subclass with its own
`__torch_dispatch__` and no inner tensors, which Dynamo would treat as an opaque Python object
(and trace into the engine itself). We register the class in Dynamo's VariableBuilder type
table (private: `torch._dynamo.variables.builder.VariableBuilder._type_dispatch_impl`), so it
is wrapped like a plain tensor: Dynamo fakeifies it into a FakeTensor on `neuron:0` (meta
kernels, our device) and the captured graph holds ordinary ATen ops. At run time those ops
reach the engine through `__torch_dispatch__` as usual. `_tensor.NeuronTensor` also defines
`__coerce_same_metadata_as_tangent__` (AOTAutograd's hook for subclass tangents), the engine's
modules are on Dynamo's skip list (`_never_traced`), and Inductor gets a refusing code
generator for 'neuron'. All are pinned by tests/integration/test_compile.py and listed in
adaptive_eager/README.md.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import time

import torch
import torch.utils._pytree as pytree

from .. import patches
from ..engine import engine as _engine
from ..engine.tensor import NeuronTensor
from ..config import config
from ..errors import NeuronInductorError, copied_view, refuse_traced_writes, traced_copy_outputs
from ..config import DEVICE_TYPE

GRAPH_REASON = "compile graph"  # the flush that runs one captured graph
BOUNDARY_REASON = "compile boundary"  # work queued before a graph starts


class CompileStats:
    """Counters of the compile mode: graphs handed to us by kind, their runs, and the wall
    time of our part of compiling them (Dynamo's and AOTAutograd's is the caller's)."""

    def __init__(self):
        self.graphs = collections.Counter()  # graphs handed to us, by kind
        self.graph_runs = 0
        self.compile_s = 0.0  # our share of compile time (wall): wrapping the graph

    def as_dict(self) -> dict:
        return {"graphs": dict(self.graphs), "graph_runs": self.graph_runs,
                "compile_s": self.compile_s}


STATS = CompileStats()


@contextlib.contextmanager
def one_segment(n_ops: int = 0):
    """Record everything inside lazily, never cut for an idle device or a full buffer.

    In eager mode the segment is flushed on the way out (reason "compile graph"); in
    adaptive mode it stays queued and joins what comes before and after it, so a graph
    boundary never costs a launch the adaptive mode would not pay (Note [Compiled graphs
    in adaptive mode]).

    The engine lock is held throughout (Note [Threads] in engine/engine.py): the mode and settings
    changed here are the process's, so another thread must neither record under them nor
    save them as its own to restore (two threads' graphs left an eager process adaptive)."""
    eng = _engine.ENGINE
    with eng.lock:
        was_lazy = eng.is_lazy()
        if not was_lazy:
            eng.flush(BOUNDARY_REASON)
        saved = (eng.adaptive, config.queue_low_threshold, config.buffer_size_limit)
        eng.adaptive = True
        config.queue_low_threshold = 0  # never cut the graph for an idle device
        config.buffer_size_limit = max(config.buffer_size_limit, len(eng.seg.nodes) + n_ops + 1)
        try:
            yield
        finally:
            try:
                if not was_lazy:
                    eng.flush(GRAPH_REASON)
            finally:
                eng.adaptive, config.queue_low_threshold, config.buffer_size_limit = saved


# Note [Compiled graphs in adaptive mode]: flushing at every graph boundary would split a
# training step into forward, backward and optimizer segments, each partitioned alone; the
# adaptive mode's partition of the whole step needs fewer launches (10 against 13 on the
# GPT step). So under adaptive eager a graph is recorded whole (no idle or buffer cuts inside
# it) and the surrounding mode decides when the queue is flushed; in eager mode each graph
# is flushed once, as its own segment.


def _lower_prims(gm: torch.fx.GraphModule) -> None:
    """The device runs ATen ops (other namespaces fall back to CPU); two prims reach our graphs
    from PyTorch's own passes, and each becomes the ATen ops of its own definition, so bit
    for bit what it computes on CPU:
    - Dynamo rewrites `addcmul_`, `addcdiv_` (with `value=`) and `add_` with a tensor `alpha`
      into Inductor's `prims.fma`, defined as `(a * b) + c`: that ATen mul and add.
    - AOTAutograd's tensorify pass (`torch.fx.passes._tensorify_python_scalars`, under
      `capture_scalar_outputs`) turns a float read by `.item()` back into a tensor with
      `prims.convert_element_type` (to float64 and back), defined as `empty_like` plus a
      copy: `aten._to_copy` with that dtype, which keeps the same layout (every `x * t.item()`
      fell back to CPU, three times per use)."""
    fma = getattr(torch.ops.prims, "fma", None)  # registered once Dynamo has used it
    cast = torch.ops.prims.convert_element_type.default
    changed = False
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if fma is not None and n.target is fma.default:
            a, b, c = n.args
            with gm.graph.inserting_before(n):
                prod = gm.graph.call_function(torch.ops.aten.mul.Tensor, (a, b))
                out = gm.graph.call_function(torch.ops.aten.add.Tensor, (prod, c))
        elif n.target is cast:
            a, dtype = (*n.args, *n.kwargs.values())
            with gm.graph.inserting_before(n):
                out = gm.graph.call_function(torch.ops.aten._to_copy.default, (a,),
                                             {"dtype": dtype})
        else:
            continue
        out.meta.update(n.meta)
        n.replace_all_uses_with(out)
        gm.graph.erase_node(n)
        changed = True
    if changed:
        gm.recompile()


def _graph_compiler(kind: str):
    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        t0 = time.perf_counter()
        _lower_prims(gm)
        n_ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        STATS.graphs[kind] += 1

        def run(args):
            STATS.graph_runs += 1
            args = list(args)  # boxed call: AOTAutograd's list is ours to empty
            with one_segment(n_ops):
                return gm(*args)

        run._boxed_call = True
        STATS.compile_s += time.perf_counter() - t0
        return run
    return compile_graph


def neuron_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """The Dynamo backend: AOTAutograd, then each graph runs as one engine segment."""
    if kwargs:  # as PyTorch's own aot_eager backend: ignored, not refused
        import warnings
        warnings.warn(f"backend 'neuron' ignores torch.compile's {sorted(kwargs)}: it compiles "
                      f"every graph one way (mode= and options= choose Inductor's behaviour)")
    refuse_traced_writes(gm)  # Note [Copied views]
    copies = traced_copy_outputs(gm)
    if any(isinstance(x, (list, tuple, dict)) for x in example_inputs):
        # A graph taking a list (compiled autograd's backward graph takes its inputs as one)
        # is flattened first, as PyTorch's AOTAutograd backends do (torch._dynamo.utils.
        # flatten_graph_inputs, private): AOTAutograd refused the list ("all flat_args must
        # be KNOWN_TYPES"), so compiled autograd failed with backend "neuron"
        from torch._dynamo.utils import flatten_graph_inputs
        compiled = flatten_graph_inputs(gm, example_inputs, _aot_autograd)
    else:
        compiled = _aot_autograd(gm, example_inputs)
    if not copies:
        return compiled

    @functools.wraps(compiled)
    def marking(*args):
        outs = compiled(*args)
        for i in copies:
            if isinstance(outs[i], NeuronTensor):
                copied_view(outs[i])
        return outs
    return marking


def _aot_autograd(gm, example_inputs):
    from torch._functorch.aot_autograd import aot_module_simplified
    return aot_module_simplified(
        gm, example_inputs,
        fw_compiler=_graph_compiler("forward"),
        bw_compiler=_graph_compiler("backward"),
        inference_compiler=_graph_compiler("inference"),
        # (as aot_eager: an inference graph writes its inputs itself, a device op, and
        # `.data =` / set_ of an input beside other changes to it compiles)
        keep_inference_input_mutations=True)


_INDUCTOR_MESSAGE = (
    "torch.compile's backend cannot run code on the 'neuron' device (only backend 'neuron' "
    "can; TorchInductor, the default, generates no neuron code). Use "
    "torch.compile(model, backend=\"neuron\"), which runs each captured graph on the device "
    "as one fused segment.")


class _Refusing(type):
    def __getattr__(cls, name):  # any question Inductor asks about the class: refuse
        raise NeuronInductorError(_INDUCTOR_MESSAGE)


class _RefuseInductor(metaclass=_Refusing):
    """Inductor's codegen entry for 'neuron': refuses with a clear error."""

    def __init__(self, *args, **kwargs):
        raise NeuronInductorError(_INDUCTOR_MESSAGE)


def _wrap_neuron_tensor(builder, value):
    """Dynamo meets a neuron tensor: a plain tensor. Inductor cannot run it, so say so before
    it tries; backends that run the captured graph's ATen ops as they are (`eager`,
    `aot_eager`, `torch._dynamo.explain`'s) run them on the device."""
    from torch._dynamo.variables.builder import VariableBuilder
    if _is_inductor_backend(builder.tx.output.compiler_fn):
        raise NeuronInductorError(_INDUCTOR_MESSAGE)
    return VariableBuilder.wrap_tensor(builder, value)


def _run_and_save_rng_state(op, *args, **kwargs):
    return torch.neuron.get_rng_state(), op(*args, **kwargs)


def _run_with_rng_state(rng_state, op, *args, **kwargs):
    now = torch.neuron.get_rng_state()
    torch.neuron.set_rng_state(rng_state.cpu())
    try:
        return op(*args, **kwargs)
    finally:
        torch.neuron.set_rng_state(now)


def _is_inductor_backend(fn) -> bool:
    """Through Dynamo's and torch.compile's wrappers, is the backend TorchInductor?"""
    for _ in range(8):
        if fn is None or fn is neuron_backend:
            return False
        if (isinstance(fn, torch._TorchCompileInductorWrapper)
                or getattr(fn, "__module__", "").startswith("torch._inductor")
                or getattr(fn, "__name__", None) == "inductor"):
            return True
        fn = (getattr(fn, "_torchdynamo_orig_backend", None)
              or getattr(fn, "compiler_fn", None))
    return False


def _refusing_neuron_graphs(call):
    """torch.compile's Inductor entry: a captured graph that makes or uses neuron tensors
    (a factory with device="neuron" inside the compiled function; neuron inputs are refused
    by `_wrap_neuron_tensor`) is refused before Inductor runs it: its constant folding
    executed neuron ops for real and failed on their storages (AttributeError `_weak_ref`:
    transformers' flex attention compiles with Inductor)."""
    def __call__(self, model_, inputs_, **kwargs):
        for node in getattr(getattr(model_, "graph", None), "nodes", ()):
            for v in pytree.tree_leaves(node.meta.get("example_value")):
                if isinstance(v, torch.Tensor) and v.device.type == DEVICE_TYPE:
                    raise NeuronInductorError(_INDUCTOR_MESSAGE)
        return call(self, model_, inputs_, **kwargs)
    return __call__


def _plain_tensor_type(infer):
    """Dynamo's `infer_subclass_type` (private) for a graph input: a neuron tensor is a plain
    tensor (Note [Dynamo and the neuron tensor]), not a `__torch_function__` subclass whose
    ops Dynamo emulates and whose outputs it converts back by a class it keeps as a global
    of the frame (lost when a graph break restarts the frame: NameError
    `__subclass_Tensor_...` after a data-dependent op; fuzzer seed 19)."""
    def infer_subclass_type(value):
        return None if type(value) is NeuronTensor else infer(value)
    return infer_subclass_type


_registered = False
# Dynamo must never trace the engine itself: a graph break (`.item()`, print, a data-
# dependent op) runs the unsupported call with Dynamo's frame hook still set, so the engine's
# frames under it would be compiled (and the flush it causes captured as a graph of its own).
# Every module of the package is skipped, listed from the package itself so that a new one
# is never missed (the hand-written list missed the stages split out of the engine, and a
# data-dependent op inside a compiled function failed in fallback.py), except `models`
# (user models, traced as any), `integration.kernels` (the kernel library's wrappers over
# its custom ops, inlined so Dynamo sees the ops) and `run` (its compile mode compiles a
# lambda of its own and patches Module.__call__, which Dynamo must inline). The package's
# __init__ cannot be listed alone (skipping it skips its directory), nor can a wing holding
# a traced module (tools, integration): their modules are listed one by one.
_TRACEABLE = {"tools.models", "tools.run", "integration.kernels"}
_WINGS = ("integration", "tools")  # (holding traced modules: listed module by module)


def _never_traced() -> list[str]:
    import pkgutil

    import adaptive_eager
    root = adaptive_eager.__path__[0]
    names = [m.name for m in pkgutil.iter_modules([root]) if m.name not in _WINGS]
    for wing in sorted(_WINGS):
        names += [f"{wing}.{m.name}" for m in pkgutil.iter_modules([f"{root}/{wing}"])]
    return [f"adaptive_eager.{n}" for n in names if n not in _TRACEABLE] + ["fusion", "device"]


def register() -> None:
    """Backend 'neuron'; Dynamo sees neuron tensors as tensors; Inductor refuses clearly.

    Idempotent. Runs when torch._dynamo is first imported (see `install`)."""
    global _registered
    if _registered:
        return
    _registered = True
    from torch._dynamo import trace_rules
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend
    from torch._dynamo.variables import builder
    from torch._dynamo.variables.builder import VariableBuilder
    from torch._inductor.codegen import common as inductor_codegen
    from fusion import decomps
    decomps.register()  # Note [Wrong decompositions in graphs]
    if "neuron" not in _COMPILER_FNS:
        register_backend(name="neuron")(neuron_backend)
    for trace_numpy in (False, True):  # Dynamo caches the table per this flag
        table = VariableBuilder._type_dispatch_impl(trace_numpy)
        table[NeuronTensor] = _wrap_neuron_tensor
    patches.patch(torch._TorchCompileInductorWrapper, "__call__", wrap=_refusing_neuron_graphs,
                  rests_on="torch._TorchCompileInductorWrapper (private), torch.compile's "
                           "Inductor entry")
    patches.patch(builder, "infer_subclass_type", wrap=_plain_tensor_type,
                  rests_on="torch._dynamo.variables.builder.infer_subclass_type (private)")
    for module in _never_traced():
        trace_rules.add(module)
    # Higher-order operators ask for a rule per tensor subclass; the neuron tensor's is the
    # one a CPU tensor reaches, the operator's dense kernel (CompositeExplicitAutograd), for
    # every operator torch._higher_order_ops defines (listed from torch._ops._higher_order_ops,
    # private; Inductor's passes define more later, which never meet a neuron tensor): an
    # effectful op in a graph (linalg.inv's error check, wrapped in with_effects) runs as on
    # the CPU; control flow (torch.cond, map, while_loop, scan, associative_scan) is Python
    # control flow over device ops, its predicate read from the device (a sync, as on CUDA);
    # a custom op that mutates its arguments, compiled (auto_functionalized_v2), while_loop's
    # backward (while_loop_stack_output) and the print operator run their ops (a hand-written
    # list of five left them out: NotImplementedError "no rule registered for HOP"). Activation
    # checkpointing's recomputation replays the device's RNG state around each random op
    # (sdpa's included, dropout or not), as CUDA's rules do (their kernels are CPU's and CUDA's).
    import torch._higher_order_ops as _defines_them_all  # noqa: F401
    from torch._C import DispatchKey
    from torch._ops import _higher_order_ops
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
    rules = {run_and_save_rng_state: _run_and_save_rng_state,
             run_with_rng_state: _run_with_rng_state}
    for hop in list(_higher_order_ops.values()):
        rule = rules.get(hop) or hop.py_kernels.get(DispatchKey.CompositeExplicitAutograd)
        if rule is not None and NeuronTensor not in hop.python_key_table:
            hop.py_impl(NeuronTensor)(rule)
    inductor_codegen.register_device_op_overrides(
        "neuron", inductor_codegen.DeviceOpOverrides())
    inductor_codegen.register_backend_for_device("neuron", _RefuseInductor, _RefuseInductor,
                                                  _RefuseInductor, _RefuseInductor)


def install() -> None:
    """Call `register` as soon as torch._dynamo exists, without importing it ourselves
    (it takes about a second, and `import torch` loads this package). make_fx traces a neuron
    tensor it was not given (a closure's, as in torch.func.linearize) as a constant, as a CPU
    or CUDA one: it refused the ops of an unknown tensor type, which ran untraced while the
    trace kept their results as constants (linearize's jvp returned uninitialized memory)."""
    import torch.fx.experimental.proxy_tensor as proxy_tensor
    from . import fake_layouts
    fake_layouts.register()  # Note [Fake layouts of the device] (torch imports fake_impls)
    patches.patch(proxy_tensor, "HANDLED_TYPES", wrap=lambda types: types + (NeuronTensor,),
                  rests_on="torch.fx.experimental.proxy_tensor.HANDLED_TYPES (private), the "
                           "tensor types make_fx traces")
    global _hooked
    if not _hooked:
        _hooked = True
        patches.after_import("torch._dynamo", lambda _: register())


_hooked = False  # the after-import hook is set once
