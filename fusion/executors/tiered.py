"""TorchInductor behind the interpreter: blocking (`inductor`) or tiered (`auto`).

Note [Executors]: a fused group's Executable is the same data for every executor; this
module only decides, per launch, whether the group's ops run through the interpreter
(`Executable.run`, bit for bit eager) or through the code TorchInductor generated for the
group's FX graph (fusion/executors/fx.py; float tolerance, not bit for bit).
- `inductor`: the first launch of a group (per set of runtime scalar values) waits for its
  compile; later launches run the compiled code.
- `auto`: a group runs interpreted; once launched `tier_up` times with the same scalars it
  is compiled on a background thread and the compiled code is swapped in when ready. The
  launching thread never waits.
Compiles always run on the one worker thread: it has its own dispatch state (the engine
flushes with the Python dispatch key disabled, which Inductor's fake tensors need), and
one compile at a time keeps the wall-clock accounting simple.
A group that cannot be compiled (random op, float64, baked-in scalars that keep changing:
Note [Scalars as graph inputs] in fx.py, an Inductor error) runs interpreted; its reason is
counted and logged once.
Caching: compiled callables live in memory per (group, baked scalar values). Across processes,
TorchInductor's own caches (FX graph cache, AOTAutograd cache, generated C++ and the shared
objects built from it) live under TORCHINDUCTOR_CACHE_DIR, which defaults to
`$TORCH_NEURONX_NEFF_CACHE_DIR/inductor`; our own cache entries stay Programs as data.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time

import torch

from device import COUNTERS, LaunchError
from .fx import NotCompilable, build, check, scalar_key, scalar_positions

log = logging.getLogger("adaptive_eager.fusion.inductor")

# A group compiled for this many distinct sets of runtime scalar values and launched with
# yet another is left to the interpreter (an optimizer's per-step values would recompile
# every step).
MAX_VARIANTS = 2


class _Group:
    """What the executor knows of one fused group (one per Program key)."""

    __slots__ = ("name", "positions", "variants", "launches", "pending", "bad")

    def __init__(self, exe, reason):
        self.name = exe.name
        self.positions = scalar_positions(exe) if reason is None else ()
        self.variants: dict[tuple, tuple] = {}  # scalar key -> (compiled fn, FxGroup)
        self.launches: collections.Counter = collections.Counter()  # per scalar key
        self.pending: dict[tuple, concurrent.futures.Future] = {}
        self.bad = reason  # why it runs interpreted for good, or None


class TieredExecutor:
    def __init__(self, *, blocking: bool, tier_up: int = 3, cache_dir: str | None = None):
        if tier_up < 1:
            raise ValueError(f"ADAPTIVE_EAGER_TIER_UP must be at least 1, got {tier_up}")
        self.blocking = blocking
        self.tier_up = tier_up
        if cache_dir:  # Inductor reads it when it first needs its cache
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_dir, "inductor"))
        self._groups: dict[tuple, _Group] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ae-inductor")
        self._lock = threading.Lock()  # counters written by both threads
        self._logged: set[str] = set()

    def launcher(self, exe, st, inputs, poisoned: set):
        """The callable that runs this launch's compiled code, or None: the interpreter
        runs it."""
        mine = exe.__dict__.get("_ae_group")  # (executor, group): a lookup by identity
        if mine is not None and mine[0] is self:
            grp = mine[1]
        else:
            grp = self._group(exe)
            exe._ae_group = (self, grp)
        if grp.bad is not None:
            return None
        key = scalar_key(grp.positions, inputs) if grp.positions else ()
        hit = grp.variants.get(key)
        if hit is None:
            hit = self._miss(grp, exe, inputs, key)
            if hit is None:
                return None
        fn, fxg = hit
        scalars = None
        if fxg.scalars:  # Note [Scalars as graph inputs] in fx.py
            scalars = fxg.scalar_input(inputs)
            if scalars is None:
                return None
        COUNTERS.compiled_launches += 1

        def run():
            args = fxg.args(st, inputs, scalars)
            try:
                with torch.no_grad():
                    outs = fn(*args)
            except Exception as e:  # the whole group's writes are invalid (Note [Poison])
                self._fail(grp, f"compiled run failed: {type(e).__name__}")
                poisoned.update(*(ins.out_slots for ins in exe.instrs))
                e.instr_index = 0
                raise LaunchError(e) from None
            fxg.store(outs, st, args)
        run.compiled = True  # benchmarks/executors.py tells compiled launches apart by it
        return run

    def _group(self, exe) -> _Group:
        key = exe.program.key
        grp = self._groups.get(key)
        if grp is None:
            grp = self._groups[key] = _Group(exe, None)
            reason = check(exe)
            if reason is not None:
                self._fail(grp, reason)
        return grp

    def _miss(self, grp, exe, inputs, key):
        if key not in grp.launches and len(grp.launches) >= MAX_VARIANTS:
            self._fail(grp, "runtime scalars change between launches")
            return None
        grp.launches[key] += 1
        fut = grp.pending.get(key)
        if fut is None:
            if not self.blocking and grp.launches[key] < self.tier_up:
                return None
            fut = grp.pending[key] = self._pool.submit(self._compile, grp, exe, inputs, key)
            if not self.blocking:
                with self._lock:
                    COUNTERS.tier_ups += 1
        if self.blocking:
            fut.result()
        return grp.variants.get(key)

    def _compile(self, grp, exe, inputs, key) -> None:
        """Worker thread: build the group's FX graph and compile it with TorchInductor."""
        import torch._inductor.config  # noqa: F401  (torch.compile's own import, lazily)
        from torch._dynamo.utils import counters
        try:
            fxg = build(exe, inputs)
            example = _fake(fxg.example_inputs())
            hits = counters["inductor"]["fxgraph_cache_hit"]
            t0 = time.perf_counter()
            # compile_threads=1: Inductor compiles in this thread instead of spawning a pool
            # of worker processes first (measured: 34 s -> 8 s to a warm first MLP step).
            with torch.no_grad(), torch._inductor.config.patch(compile_threads=1):
                fn = torch._inductor.compile(fxg.gm, example)
            dt = time.perf_counter() - t0
        except NotCompilable as e:
            self._fail(grp, e.reason)
            return
        except Exception as e:  # noqa: BLE001  Inductor could not compile it: the interpreter runs it
            self._fail(grp, f"inductor: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                       if str(e) else f"inductor: {type(e).__name__}")
            return
        with self._lock:
            COUNTERS.inductor_compile_s += dt
            COUNTERS.compiled_groups += 1
            COUNTERS.inductor_cache_hits += \
                counters["inductor"]["fxgraph_cache_hit"] - hits
        log.info("inductor compiled %s (%d ops) in %.2f s", grp.name[:100],
                 len(exe.instrs), dt)
        grp.variants[key] = (fn, fxg)  # swapped in: the next launch runs it

    def _fail(self, grp, reason: str) -> None:
        if grp.bad is not None:
            return
        grp.bad = reason
        with self._lock:
            COUNTERS.compile_failures[reason] += 1
        if reason not in self._logged:  # each reason logged once
            self._logged.add(reason)
            log.log(logging.WARNING if reason.startswith(("inductor", "compiled")) else
                    logging.INFO, "group %s runs interpreted: %s", grp.name[:80], reason)

    def wait(self) -> None:
        """Block until every compile submitted so far has finished (tests, benchmarks)."""
        for grp in list(self._groups.values()):
            for fut in list(grp.pending.values()):
                fut.result()

    def groups(self) -> list[tuple[str, bool, str | None]]:
        """(name, compiled, reason it is not) per group seen."""
        return [(g.name, bool(g.variants), g.bad) for g in self._groups.values()]


def _fake(tensors):
    """Fake example inputs with static shapes under a ShapeEnv: without a ShapeEnv,
    Inductor bypasses its FX graph cache ('No shape env') and every process recompiles."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    mode = FakeTensorMode(shape_env=ShapeEnv())
    return [mode.from_tensor(t, static_shapes=True) for t in tensors]
