"""What each stage of the engine costs per op, on the tiny chain of test_host_overhead.py:

    python benchmarks/stage_costs.py [--strategy graph] [--steps 20]

The chain runs process-wide adaptive (as TORCH_NEURONX_ENABLE_CONCATENATION=1 sets it), with
the default policy. A plain timed run gives the engine's host time per op (best of the steps)
beside plain CPU torch and the do-nothing `__torch_dispatch__` floor; a profiled run splits
it by stage: each stage's share of the profiled time, applied to the plain run's per-op time
(cProfile inflates every call, so only the shares are taken from it). Two lower bounds
show what any lazy Python engine pays before doing anything: the dispatch entry alone (a
`__torch_dispatch__` that hands back its argument) and the entry plus the output's wrapper
tensor; the op itself runs later, at the flush, at about CPU's cost. A third, `_Replay`, is
the least a cached-trace engine does (each op checked against a recorded trace by identity,
the flush one generated function): what the 5x CPU target leaves for the engine's own work is
the gap between it and 5x.
"""
import argparse
import cProfile
import os
import pstats
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import adaptive_eager as ae  # noqa: E402
from test_host_overhead import CHAIN, Floor, chain  # noqa: E402

# stage -> the function whose cumulative time is the stage (file suffix, function name)
STAGES = [
    # Note [Replay]: steady-state ops match the trace and are queued there (less flushes)
    ("replay: match the trace + queue + result", "adaptive_eager/engine/replay.py", "follow"),
    # the slow path: ops that do not match
    ("templates (arguments -> cache key)", "adaptive_eager/engine/templates.py", "template"),
    ("meta inference (new signatures only)", "adaptive_eager/engine/meta.py", "infer"),
    ("queue: record + online grouping", "adaptive_eager/engine/queue.py", "record"),  # less flushes
    ("results (wrapper tensors)", "adaptive_eager/engine/results.py", "results"),
    ("flush: plan + run executables", "adaptive_eager/engine/engine.py", "flush"),  # syncs: rest
]


class _Entry(torch.Tensor):
    """The dispatch entry alone: returns its first argument, makes nothing."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return args[0]


class _Wrapped(_Entry):
    """The entry plus one wrapper tensor made as NeuronTensor makes its own."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        a = args[0]
        return torch.Tensor._make_wrapper_subclass(
            cls, a.shape, strides=a.stride(), storage_offset=0, dtype=a.dtype,
            device=a.device, storage_size=1 << 62)


class _Replay(_Entry):
    """The least a cached-trace engine does per op: under a lock, check the op against the
    trace recorded at this position (the op, its tensor argument by identity, its scalar)
    and hand back a wrapper of the recorded layout; the flush runs the whole trace as one
    generated Python function of ATen calls. No handles, memory, source lines, grouping,
    counters or simulated device: a bound, not an engine."""
    lock = threading.RLock()
    trace: list = []  # (op, scalar, shape, stride) per position, recorded by `record`
    outs: list = []  # this replay's tensors: the input, then each op's output

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with cls.lock:
            outs = cls.outs
            op, scalar, shape, stride = cls.trace[len(outs) - 1]
            if op is not func or args[0] is not outs[-1] or args[1] != scalar or kwargs:
                raise RuntimeError("off the trace")
            out = torch.Tensor._make_wrapper_subclass(
                cls, shape, strides=stride, storage_offset=0, dtype=torch.float32,
                storage_size=1 << 62)
            outs.append(out)
            return out

    @classmethod
    def record(cls, x):
        """Record the chain's trace (through a recording subclass) and generate its flush."""
        seen = []

        class Rec(_Entry):
            @classmethod
            def __torch_dispatch__(c, func, types, args=(), kwargs=None):
                seen.append((func, args[1], tuple(args[0].shape), args[0].stride()))
                return args[0]

        chain(Rec(x.shape))
        cls.trace = seen
        ops = {f"f{i}": func._op for i, (func, *_) in enumerate(seen)}  # the C++ op itself
        body = "".join(f"    v = f{i}(v, {s!r})\n" for i, (_, s, _, _) in enumerate(seen))
        exec(f"def flush(v):\n{body}    return v\n", ops)
        return ops["flush"]


def per_op_us(step, steps: int) -> float:
    step()
    best = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return best / CHAIN * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="graph")
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    x = torch.randn(16)
    cpu = per_op_us(lambda: chain(x), a.steps)
    floor = per_op_us(lambda: chain(Floor(x)), a.steps)
    entry = per_op_us(lambda: chain(_Entry(x.shape)), a.steps)
    wrapped = per_op_us(lambda: chain(_Wrapped(x.shape)), a.steps)
    flush = _Replay.record(x)
    xr = _Replay(x.shape)

    def replay():
        _Replay.outs = [xr]
        chain(xr)
        return flush(x)

    assert torch.equal(replay(), chain(x))
    bound = per_op_us(replay, a.steps)
    xn = x.to("neuron")
    ae.set_adaptive(True)
    ae.set_strategy(a.strategy)

    def step():
        chain(xn)
        torch.neuron.synchronize()

    engine = per_op_us(step, a.steps)
    prof = cProfile.Profile()
    prof.runcall(lambda: [step() for _ in range(a.steps)])
    stats = pstats.Stats(prof).stats
    total = sum(tt for (_, _, _), (_, _, tt, _, _) in stats.items())
    print(f"host time per op, adaptive {a.strategy}, default policy ({CHAIN}-op chain):")
    print(f"  plain CPU torch      {cpu:7.2f} us")
    print(f"  dispatch floor       {floor:7.2f} us  ({floor / cpu:.1f}x CPU)")
    print(f"  dispatch entry only  {entry:7.2f} us   + a wrapper tensor {wrapped:.2f} us   "
          f"+ the op at the flush (CPU's) {wrapped + cpu:.2f} us ({(wrapped + cpu) / cpu:.1f}x CPU)")
    print(f"  cached-trace bound   {bound:7.2f} us  ({bound / cpu:.1f}x CPU: _Replay, a replay "
          f"with no engine work)")
    print(f"  engine               {engine:7.2f} us  ({engine / cpu:.1f}x CPU, "
          f"{engine / floor:.1f}x the floor)")
    print("  by stage (share of the profiled time, as us of the engine's per-op time):")

    def cum(path, func, exclude=None):
        """Cumulative time of `func`, less what it spent in `exclude` (a stage of its own)."""
        out = 0.0
        for (f, _, fn), (_, _, _, ct, _) in stats.items():
            if f.endswith(path) and fn == func:
                out += ct
        if exclude is not None:
            for (f, _, fn), (_, _, _, _, callers) in stats.items():
                if f.endswith(exclude[0]) and fn == exclude[1]:
                    out -= sum(c[3] for (cf, _, cfn), c in callers.items()
                               if cf.endswith(path) and cfn == func)
        return out

    flush = ("adaptive_eager/engine/engine.py", "locked")  # Engine.flush, through its lock wrapper
    shown = 0.0
    for name, path, func in STAGES:
        t = cum(path, func, flush if func in ("record", "follow") else None)
        shown += t
        print(f"    {name:38s} {t / total * engine:6.2f} us  ({t / total:5.1%})")
    rest = total - shown
    print(f"    {'the rest (dispatch, Python glue)':38s} {rest / total * engine:6.2f} us  "
          f"({rest / total:5.1%})")

if __name__ == "__main__":
    main()
