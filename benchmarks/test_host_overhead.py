"""Host time per op on a chain of tiny pointwise ops (issue: the per-op path), in one run:
plain CPU torch, a do-nothing `__torch_dispatch__` subclass (the floor any Python backend
pays; `entry`: its entry alone, a dispatch that returns its input unrun), PyTorch's own lazy tensors (`torch._lazy`, its TorchScript backend: a C++ tracer, the
design PyTorch/XLA uses), and neuron eager, scoped adaptive (`with ae.adaptive():` around an
eager process) and process-wide adaptive (`ae.set_adaptive(True)`; mode `graph`) with the
default policy. Then the same modes on programs that take the slow paths (views, `copy_`,
`a[i] = row`, tensor lists, host tensors). The time per op of a program is its step's median
over ATen ops per step (counted on CPU); the ratios between modes come from one run:

    python -m pytest benchmarks/test_host_overhead.py --benchmark-enable -p no:randomly \
        --benchmark-json=host.json
    python -m adaptive_eager report host.json       # the tables, ratios to CPU
"""
import contextlib

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.tools.pytest_plugin import CountOps, mode_scope
from workloads import lazy_device, ltc_sync

CHAIN = 800  # ops per step: `x * 1.0001 + 0.001`, 400 times, on 16 floats
SLOW = 50  # iterations per step of a slow-path program
MODES = ["cpu", "floor", "ltc", "eager", "scoped", "graph"]
CHAIN_MODES = ["cpu", "entry", *MODES[1:]]  # (`entry` computes nothing: the chain only)


class Floor(torch.Tensor):
    """A wrapper subclass whose dispatch does nothing but unwrap, run and wrap."""

    @staticmethod
    def __new__(cls, inner):
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, inner.stride(),
                                                 inner.storage_offset(), dtype=inner.dtype)
        t.inner = inner
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        a = [x.inner if type(x) is Floor else
             [y.inner if type(y) is Floor else y for y in x] if type(x) is list else x
             for x in args]
        out = func(*a, **(kwargs or {}))
        return Floor(out) if isinstance(out, torch.Tensor) else out


class Entry(Floor):
    """The floor's entry alone: into Python dispatch and back, the op not run, no tensor made
    (each op returns its input)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return args[0]


def chain(x):
    for _ in range(CHAIN // 2):
        x = x * 1.0001 + 0.001
    return x


# The slow-path programs: (state from a CPU tensor of 16 floats, moved to the device) -> step.
def views(x):
    def step():
        y = x
        for _ in range(SLOW):
            y = (y.view(4, 4).t() * 1.0001).reshape(16)
        return y
    return step


def copies(x):
    buf = torch.empty_like(x)

    def step():
        y = x
        for _ in range(SLOW):
            buf.copy_(y)
            y = buf * 1.0001
        return y
    return step


def setitem(x):
    a = torch.zeros(8, 16, device=x.device)

    def step():
        y = x
        for i in range(SLOW):
            a[i % 8] = y
            y = y * 1.0001
        return a
    return step


def tensor_lists(x):
    def step():
        y = x
        for _ in range(SLOW):
            y = torch.stack([y, y * 1.0001]).sum(0)
        return y
    return step


def host_tensors(x):
    s = torch.tensor(1.0001)  # a 0-dim CPU tensor beside device tensors, as CPU accepts

    def step():
        y = x
        for _ in range(SLOW):
            y = y * s
        return y
    return step


PROGRAMS = {"views": views, "copy_": copies, "setitem": setitem, "tensor_lists": tensor_lists,
            "host_tensors": host_tensors}

@contextlib.contextmanager
def in_mode(mode):
    """The mode for the block; yields (device, sync after a step)."""
    if mode in ("cpu", "floor", "entry"):
        yield "cpu", None
    elif mode == "ltc":
        yield lazy_device(), ltc_sync
    elif mode == "scoped":  # an eager process, adaptive inside the block
        with mode_scope("eager"), ae.adaptive():
            yield "neuron", torch.neuron.synchronize
    else:
        with mode_scope(mode):
            yield "neuron", torch.neuron.synchronize


def run(benchmark, mode, make, ops):
    x0 = torch.randn(16, generator=torch.Generator().manual_seed(0))
    with in_mode(mode) as (device, sync):
        x = Floor(x0) if mode == "floor" else Entry(x0) if mode == "entry" else x0.to(device)
        body = make(x)

        def step():
            y = body()
            if sync is not None:
                sync()
            return y

        step()  # warm: compiles, plans, traces
        step()
        result = benchmark.pedantic(step, rounds=10, warmup_rounds=1)
        out = result.inner if isinstance(result, Floor) else result.cpu()
    benchmark.extra_info.update(mode=mode, ops_per_step=ops)
    if benchmark.stats is not None:  # (None under --benchmark-disable: the suite's smoke run)
        benchmark.extra_info.update(us_per_op=benchmark.stats.stats.median / ops * 1e6)
    return out, x0


@pytest.mark.parametrize("mode", CHAIN_MODES)
def test_tiny_chain(benchmark, mode):
    benchmark.group = "tiny_chain"
    out, x0 = run(benchmark, mode, lambda x: lambda: chain(x), CHAIN)
    # What was timed computed CPU's values: the same kernels in the same order, bit for bit
    # (lazy tensors run TorchScript's fused kernels: within float tolerance)
    if mode == "ltc":
        torch.testing.assert_close(out, chain(x0))
    elif mode == "entry":  # (computes nothing: each op returned its input)
        assert torch.equal(out, x0)
    else:
        assert torch.equal(out, chain(x0))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_slow_paths(benchmark, program, mode):
    benchmark.group = f"slow_path:{program}"
    x0 = torch.randn(16, generator=torch.Generator().manual_seed(0))
    cpu_step = PROGRAMS[program](x0.clone())
    with CountOps() as c:
        cpu_step()
    out, x0 = run(benchmark, mode, PROGRAMS[program], c.n)
    benchmark.extra_info.update(program=program)
    # (the benchmark ran the step 13 times: setitem's `a` holds the last round's rows)
    expected = PROGRAMS[program](x0.clone())()
    torch.testing.assert_close(out, expected)


ROWS = 256  # assignments per step (issue 23: PyTorch's reference loop for index_copy)
HEIGHT = 1 << 16  # rows of `a`: every step of every test assigns rows no step used before
_NEXT_ROW = [0]  # (a view at an index seen before is a meta-cache hit: not what is measured)
LOOPS = {  # (row source, a step's body): `a[i] = row` with a device or host row, `a[i] = src[i]`
    "row": lambda a, row, src, i: a.__setitem__(i, row),
    "host_row": lambda a, row, src, i: a.__setitem__(i, row),
    "src": lambda a, row, src, i: a.__setitem__(i, src[i]),
}


@pytest.mark.parametrize("mode", ["cpu", "eager", "graph"])
@pytest.mark.parametrize("loop", list(LOOPS))
def test_row_assignment_loop(benchmark, loop, mode):
    """Host time per assignment of a row loop into a fresh `a` (rows at offsets no step saw
    before: Note [Direct copies], Note [View inference]); the report's `host us/op` is per
    assignment here, and its `vs cpu` the ratio to CPU in this run (issue 23's bound: 20x)."""
    benchmark.group = f"row_assignment:{loop}"
    dev = "neuron" if mode != "cpu" else "cpu"
    g = torch.Generator().manual_seed(0)
    src0, row0 = torch.randn(HEIGHT, 8, generator=g), torch.randn(8, generator=g)
    with mode_scope(mode if dev == "neuron" else "cpu") as device:
        src = src0.to(device)
        row = row0 if loop == "host_row" else row0.to(device)
        body = LOOPS[loop]

        def fresh():  # (made outside the timed step: what is timed is the assignments)
            return (torch.zeros(HEIGHT, 8, device=device),), {}

        def step(a):
            base = _NEXT_ROW[0] % (HEIGHT - ROWS)
            _NEXT_ROW[0] += ROWS
            for i in range(base, base + ROWS):
                body(a, row, src, i)
            if dev == "neuron":
                torch.neuron.synchronize()
            return a, base

        step(*fresh()[0])
        a, base = benchmark.pedantic(step, setup=fresh, rounds=5, warmup_rounds=0)
        want = torch.zeros(HEIGHT, 8)
        for i in range(base, base + ROWS):
            body(want, row0, src0, i)
        assert torch.equal(a.cpu(), want)
    info = dict(mode=mode, workload=benchmark.group, assignments_per_step=ROWS)
    if benchmark.stats is not None:  # (None under --benchmark-disable)
        info.update(host_us_per_op=benchmark.stats.stats.min / ROWS * 1e6)
    benchmark.extra_info.update(info)
