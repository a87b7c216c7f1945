"""Host time per op on a chain of tiny pointwise ops (issue: the per-op path), in one run:
plain CPU torch, a do-nothing `__torch_dispatch__` subclass (the floor any Python backend
pays), and neuron eager / adaptive with the default policy. Figures are ratios to CPU in the
same process (`extra_info`); the README records a measured run:

    python -m pytest benchmarks/test_host_overhead.py --benchmark-enable -p no:randomly
"""
import pytest
import torch

from adaptive_eager.tools.pytest_plugin import mode_scope

CHAIN = 800  # ops per step: `x * 1.0001 + 0.001`, 400 times, on 16 floats


class Floor(torch.Tensor):
    """A wrapper subclass whose dispatch does nothing but unwrap, run and wrap."""

    @staticmethod
    def __new__(cls, inner):
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
        t.inner = inner
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        a = [x.inner if type(x) is Floor else x for x in args]
        out = func(*a, **(kwargs or {}))
        return Floor(out) if isinstance(out, torch.Tensor) else out


def chain(x):
    for _ in range(CHAIN // 2):
        x = x * 1.0001 + 0.001
    return x


@pytest.mark.parametrize("mode", ["cpu", "floor", "eager", "graph"])
def test_tiny_chain(benchmark, mode):
    benchmark.group = "tiny_chain"
    x = torch.randn(16)
    if mode == "floor":
        x = Floor(x)
    dev = "neuron" if mode in ("eager", "graph") else "cpu"
    with mode_scope(mode if dev == "neuron" else "cpu") as device:
        x = x.to(device) if dev == "neuron" else x

        def step():
            y = chain(x)
            if dev == "neuron":
                torch.neuron.synchronize()
            return y

        step()  # warm: compiles, plans
        result = benchmark.pedantic(step, rounds=10, warmup_rounds=1)
        benchmark.extra_info.update(mode=mode, ops_per_step=CHAIN)
    # What was timed computed CPU's values: the same kernels in the same order, bit for bit.
    host = {"cpu": lambda t: t, "floor": lambda t: t.inner}.get(mode, lambda t: t.cpu())
    assert torch.equal(host(result), chain(host(x)))
    expected = chain(torch.randn(16, generator=torch.Generator().manual_seed(0)))
    assert result.shape == expected.shape


ROWS = 64  # `a[i] = row` per step (issue 23: PyTorch's reference loop for index_copy)


@pytest.mark.parametrize("mode", ["cpu", "eager", "graph"])
def test_row_assignment_loop(benchmark, mode):
    """Host time per `a[i] = row`: each row is a new op signature on the device (a view's
    offset is in the key), so this measures meta inference, the probe and an executable per
    row, against CPU's ~5 us (README, Known gaps)."""
    benchmark.group = "row_assignment"
    dev = "neuron" if mode != "cpu" else "cpu"
    with mode_scope(mode if dev == "neuron" else "cpu") as device:
        state = {"n": 0}

        def step():
            a = torch.zeros(4096, 8, device=device)  # fresh rows: no signature seen before
            row = torch.ones(8, device=device)
            base = state["n"] % 4000
            state["n"] += ROWS
            for i in range(base, base + ROWS):
                a[i] = row
            if dev == "neuron":
                torch.neuron.synchronize()
            return a

        step()
        benchmark.pedantic(step, rounds=3, warmup_rounds=0)
        benchmark.extra_info.update(mode=mode, assignments_per_step=ROWS)
