"""Host time per op on test_host_overhead.py's tiny chain, two ways that a pytest-benchmark run
does not give (issue 29's analysis; results.md):

    OMP_NUM_THREADS=1 python benchmarks/host_per_op.py interleave 8   # modes in turn, one process
    python benchmarks/host_per_op.py bytecodes graph 20                # Python bytecodes per op

`interleave ROUNDS`: each round times every mode (best of 7 steps by thread CPU time), the
modes one after the other, and prints each mode's median over the rounds: a shared machine's
load falls on every mode alike, so the ratios hold where one run per mode would drift.
`bytecodes MODE [TOP]`: the bytecodes the interpreter runs per op in a steady step (a tracer
counts them; exact, unlike time), and the TOP functions running most of them.
"""
import collections
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import adaptive_eager as ae  # noqa: E402
from adaptive_eager.tools.pytest_plugin import mode_scope  # noqa: E402
from test_host_overhead import CHAIN, Entry, Floor, chain  # noqa: E402

MODES = ("cpu", "entry", "floor", "graph", "scoped", "eager")


@contextlib.contextmanager
def in_mode(mode):
    """(the chain's input, the sync after a step) in `mode`."""
    x0 = torch.randn(16)
    if mode in ("cpu", "floor", "entry"):
        yield {"cpu": x0, "floor": Floor(x0), "entry": Entry(x0)}[mode], lambda: None
        return
    scope = ae.adaptive() if mode == "scoped" else contextlib.nullcontext()
    with mode_scope("eager" if mode == "scoped" else mode), scope:
        yield x0.to("neuron"), torch.neuron.synchronize


def interleave(rounds: int) -> None:
    per = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode in MODES:
            with in_mode(mode) as (x, sync):
                for _ in range(3):  # warm: plans, traces
                    chain(x), sync()
                best = float("inf")
                for _ in range(7):
                    t = time.thread_time()
                    chain(x), sync()
                    best = min(best, time.thread_time() - t)
            per[mode].append(best / CHAIN * 1e6)
    med = {m: statistics.median(v) for m, v in per.items()}
    for m in MODES:
        print(f"{m:7s} {med[m]:7.2f} us/op  {med[m] / med['cpu']:5.2f}x CPU")
    print(f"eager/graph {med['eager'] / med['graph']:.2f}x  "
          f"scoped/graph {med['scoped'] / med['graph']:.2f}x")


def bytecodes(mode: str, top: int) -> None:
    per, n = collections.Counter(), [0]

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            n[0] += 1
            per[frame.f_code.co_qualname] += 1
        return tracer
    with in_mode(mode) as (x, sync):
        for _ in range(3):
            chain(x), sync()
        sys.settrace(tracer)
        chain(x), sync()
        sys.settrace(None)
    print(f"{mode}: {n[0] / CHAIN:.0f} bytecodes per op")
    for name, k in per.most_common(top):
        print(f"  {k / CHAIN:7.1f}  {name}")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "interleave"
    if what == "interleave":
        interleave(int(sys.argv[2]) if len(sys.argv) > 2 else 8)
    else:
        bytecodes(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
