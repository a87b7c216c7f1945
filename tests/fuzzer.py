"""Differential fuzzer: random straight-line programs on CPU, neuron eager and adaptive eager.

    python tests/fuzzer.py --minutes 10 --mode graph --policy lazy --seed 1
    python tests/fuzzer.py --programs 200 --mode all --seed 0        # every mode, both policies

Stages, one function each: `generate` (a program: a list of one-line Python statements over
variables v0, v1, ...), `run_program` (execute it on one device/mode and read every variable
back), `compare` (the rules below), `shrink` (delete statements, then shrink shapes, while the
failure keeps its signature) and `Pool` (a persistent worker child process: programs go in as
JSON lines on stdin, results come back on stdout, so an abort or a hang is caught, reported and
shrunk like any other failure).

Note [Comparison rules]:
- Errors: each run stops at its first exception. CPU raises at statement i with type T =>
  neuron raises T at i (immediate), or, at some j >= i no later than the next explicit sync
  statement, `ae.NeuronRuntimeError` (deferred, as adaptive_eager/README.md documents; every
  program ends with a sync) or the exception CPU raises at j too (i is still pending), or any
  exception at a statement j > i reading what statement i left undefined (i's error is pending;
  CUDA too raises a shape error at the call before an earlier asynchronous one). Neuron raising
  where CPU does not, or a different type, is a failure. The statement a neuron run stopped at
  counts as failed in the reference (its effects are unknown).
- Values: the CPU reference runs every statement, skipping the ones that raise; a skipped
  statement *taints* what it defines and mutates (and everything aliasing it, found from CPU
  storage sharing), and so does every statement reading a tainted variable. Untainted
  variables must match: dtype, shape, strides (dims of size > 1; storage offset too), values
  (exact for integers and bools, float32 `assert_close` defaults, NaN equal to NaN) and `.grad`.
  After a deferred error, reading an untainted variable may raise NeuronRuntimeError (clearly
  marked invalid) but must never give a wrong value. So may it after both raised at one
  statement in other words: a check above the device (autograd's "does not support automatic
  differentiation for outputs with complex dtype") refused after the op was queued, where
  CPU's kernel refused its values first; the op's own error follows at the next sync, as
  CUDA's asynchronous kernel errors do (seed 96836). Tainted values are not compared.
- Float64 policy (adaptive_eager/README.md, "CPU fallback and dtypes"): the device stores
  float64 but computes it as float32, random streams included. A value is *f64-tainted* when
  it, or anything it was computed from, is float64: floating values are compared against CPU's
  float64 result cast to float32 (float32 saturation included: where that is infinite or beyond
  1e18, inf or NaN are allowed, since float32 saturates inside an op and inf arithmetic gives
  NaN, as CPU's own float32 mean of four 8.5e37s and gelu(inf) do) with rtol = atol = 1e-3;
  integer and bool values derived from float64 (comparisons, argmax, casts), and everything
  computed from them, get dtype/shape/stride checks only; values from a float64 input through
  an op where rounding can flip a discrete outcome (a mask's selection, nonzero, %, floor,
  round, sign, ...) get a dtype check only. Values that depend on a float64 random op get
  dtype/shape/stride checks only (the device draws them from the float32 stream), and so do
  later random draws until the next `manual_seed` (the streams have moved apart). float32
  random ops use CPU's stream and are compared as any value. Whether a statement reading a
  value whose shape is so left free raises (an index past the end of `where(mask)[0]`) is free
  too: where the runs first part at such a statement, only what ran before it is compared.
- Gradients through a full min/max/median reduction may be NaN on neuron where CPU's are 0:
  PyTorch's own formula for devices and tensor subclasses (`_EVENLY`).
- Adaptive vs eager: the same error outcome and, where both read a value, bit for bit equal
  (NaN equal to NaN, -0.0 distinct from 0.0), every dtype, f64 included.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import select
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

MODES = ["eager", "graph", "matmul", "none"]
POLICIES = ["default", "lazy"]  # default: queue_low_threshold as configured; lazy: 0
# threads: the default policy while three other threads issue, sync and check their own ops on the
# same device (Note [Threads] in adaptive_eager/engine/engine.py); `--policy all` adds it.
THREADS = "threads"
# compile: the program as one function under torch.compile(backend="neuron") in the mode,
# against the same function under backend "aot_eager" on CPU (`run_compiled`).
COMPILE = "compile"
# inductor: adaptive with the Inductor executor (fused groups run as TorchInductor's code),
# against neuron eager within float tolerance (`compare_close`); not for mode eager.
INDUCTOR = "inductor"
# repeat: the default policy with replay checked (check_replay), the program run 3 times in
# one adaptive scope from the same seed, the last run compared: the second and third runs are
# queued from the first's trace (Note [Replay] in adaptive_eager/engine/replay.py).
REPEAT = "repeat"

PRELUDE = ("import torch, torch.nn.functional as F, adaptive_eager as ae\n"
           "dev = 'neuron'   # 'cpu' for the reference\n"
           "dev1, dev2, dev3 = 'neuron:1', 'neuron:2', 'neuron:3'   # other cores\n"
           "torch.manual_seed(0)\n")

_VAR = re.compile(r"\bv\d+\b")
_DEF = re.compile(r"^(v\d+)\s*=[^=]")
_INPLACE = re.compile(r"\.(?!requires_grad_)[a-z_0-9]+_\(")
_SETITEM = re.compile(r"^(v\d+)\b[^=]*[^=<>!]([-+*/]?)=[^=]")   # v1[..] = x, v1.mT[0] += x, v1 *= x
_OUT = re.compile(r"\bout=(v\d+)")
_CUSTOM_WRITE = re.compile(r"\bfz\.\w+_\((v\d+)")  # fz.addto_(v1, v2) writes v1 (`_fz`)
# torch._foreach_add_([v1, v2], ...) and torch.optim.SGD([v1], ...).step() write their list,
# GradScaler's torch._amp_foreach_non_finite_check_and_unscale_([v1], v2, v3) v2 too
_LIST_WRITE = re.compile(r"torch\.(?:_foreach_\w+_|_amp_foreach_\w+_|optim\.\w+)\(\[([^\]]*)\]"
                         r"(?:, (v\d+))?")
_AMP_UPDATE = re.compile(r"torch\._amp_update_scale_\((v\d+), ")


def _receiver(code: str, end: int) -> str | None:
    """The variable an in-place method ending at `end` writes: the first variable of its
    receiver chain (`v2.mT[0].mul_(2)` writes v2)."""
    depth, k = 0, end
    while k > 0:
        c = code[k - 1]
        if c in ")]":
            depth += 1
        elif c in "([":
            if depth == 0:
                break
            depth -= 1
        elif depth == 0 and c in " ,=":
            break
        k -= 1
    m = _VAR.match(code, k)
    return m.group(0) if m else None
_SYNC = re.compile(r"synchronize\(\)|\.cpu\(\)|\.item\(\)|\.tolist\(\)")


# --------------------------------------------------------------------------- statements

def stmt_info(code: str) -> dict:
    """What a statement reads, defines and mutates, from its text."""
    d = _DEF.match(code)
    defs = d.group(1) if d else None
    muts = {v for v in (_receiver(code, m.start()) for m in _INPLACE.finditer(code)) if v}
    muts.update(m.group(1) for m in _OUT.finditer(code))
    for m in _LIST_WRITE.finditer(code):
        muts.update(_VAR.findall(m.group(1)))
        if m.group(2) and "_amp_" in m.group(0):
            muts.add(m.group(2))
    muts.update(m.group(1) for m in _AMP_UPDATE.finditer(code))
    muts.update(m.group(1) for m in _CUSTOM_WRITE.finditer(code))
    if not d and (m := _SETITEM.match(code)):
        muts.add(m.group(1))
    rhs = code[d.end() - 1:] if d else code
    if code.startswith("del "):
        rhs = ""
    reads = set(_VAR.findall(rhs)) | muts
    return {"defs": defs, "muts": muts, "reads": reads,
            "backward": ".backward(" in code, "sync": bool(_SYNC.search(code)),
            "random": bool(re.search(r"\b(rand|randn|randint|randperm|rand_like|randn_like|"
                                     r"dropout|native_dropout|bernoulli|normal_|uniform_|"
                                     r"multinomial|random_)\b", code)),
            "deletes": code[4:].strip() if code.startswith("del ") else None}


# --------------------------------------------------------------------------- generator

FAMILIES = ["pointwise", "view", "inplace", "out", "dtype", "reduce", "matmul", "index",
            "scatter", "random", "shape", "nn", "autograd", "optim", "lowp", "sync", "del",
            "settings", "complex", "outview", "intrng", "storage", "errors", "linalg", "edge", "cores", "alias",
            "custom", "threads"]  # "errors": keep now and then a statement that raises on CPU

# Note [CI exclusions]: families and statement patterns left out of the CI pass (`--ci`,
# tests/test_fuzz.py) because they hit engine bugs that are known and not fixed yet (issue 8);
# each entry carries its minimal repro. The long-run command runs everything. Remove an entry
# once its bug is fixed and the CI pass still passes.
# Known bugs left out of the CI pass, each with its repro (empty: every family and op the
# generator knows runs in CI). Add an entry only with a repro and an issue, and remove it
# with the fix.
CI_EXCLUDED_FAMILIES: dict[str, str] = {}
CI_EXCLUDED_PATTERNS: dict[str, str] = {}


class Gen:
    """Builds one program, running each candidate statement on CPU to learn shapes/dtypes."""

    def __init__(self, seed: int, families=None, exclude=(), length=(6, 18)):
        import torch
        self.torch = torch
        self.r = random.Random(seed)
        fams = list(families or FAMILIES)
        self.keep_error = 0.04 if "errors" in fams else 0.0
        self.families = [f for f in fams if f != "errors"]
        self.exclude = [re.compile(p) for p in exclude]
        self.length = length
        self.ns = _namespace("cpu")
        self.stmts: list[str] = []
        self.n = 0
        self.core: dict[str, int] = {}  # variables on a core other than 0 ("cores" family)
        self.pending_core: tuple[str, int] | None = None  # what the statement in hand defines

    # -- helpers
    def fresh(self):
        v = f"v{self.n}"
        self.n += 1
        return v

    def vars(self, pred=lambda t: True, core=0):
        """Variables satisfying `pred` on neuron core `core` (the "cores" family puts some on
        cores 1-3; every other family reads core 0's, as an op mixing cores raises)."""
        T = self.torch.Tensor
        return [k for k, t in self.ns.items()
                if _VAR.fullmatch(k) and isinstance(t, T) and self.core.get(k, 0) == core
                and pred(t)]

    def pick(self, pred=lambda t: True):
        vs = self.vars(pred)
        return self.r.choice(vs) if vs else None

    def shape(self, maxdim=3):
        r = self.r
        nd = r.choice([0, 1, 1, 2, 2, 2, 3, 3][: 2 + 2 * maxdim])
        return tuple(r.choice([0, 1, 2, 3, 4, 5]) if r.random() < 0.1 else r.choice([1, 2, 3, 4, 5])
                     for _ in range(nd))

    def lit(self):
        return self.r.choice(["0", "1", "2", "-1", "0.5", "-1.5", "3", "1e-3", "100.0", "False",
                              "True", "float('nan')", "-0.0"])

    def host(self):
        """A 0-d CPU tensor: an operand beside device tensors (CUDA's rule, and ours)."""
        return f"torch.tensor({self.lit()})"

    def dim(self, t):
        return self.r.randrange(-t.dim(), t.dim()) if t.dim() else 0

    def idx(self, n, k=None):
        k = k or self.r.randint(1, 4)
        hi = n + (1 if self.r.random() < 0.05 else 0)  # now and then an out-of-range index
        vals = [self.r.randrange(-n, hi) if hi > -n and n else 0 for _ in range(k)]
        return f"torch.tensor({vals}, device=dev)"

    def create(self):
        v, r, s = self.fresh(), self.r, self.shape()
        kind = r.choice(["randn", "randn", "randint", "bool", "arange", "full", "tensor", "f64"])
        if kind == "randn":
            return f"{v} = torch.randn({s}, device=dev)"
        if kind == "f64":
            return f"{v} = torch.randn({s}, device=dev).double()"
        if kind == "randint":
            return f"{v} = torch.randint(-4, 5, {s}, device=dev)"
        if kind == "bool":
            return f"{v} = torch.rand({s}, device=dev) > 0.5"
        if kind == "arange":
            n = r.randint(0, 8)
            return f"{v} = torch.arange({n}{r.choice(['.', ''])}, device=dev)"
        if kind == "full":
            return f"{v} = torch.full({s}, {self.lit()}, device=dev)"
        vals = [r.choice([0, 1, -2, 3, 7]) for _ in range(r.randint(1, 4))]
        return f"{v} = torch.tensor({vals}, device=dev)"

    # -- families: each returns a statement or None (not applicable right now)
    def f_pointwise(self):
        r, v = self.r, self.fresh()
        a = self.pick()
        if a is None:
            return None
        t = self.ns[a]
        if r.random() < 0.4:
            fl = ["neg", "abs", "exp", "sin", "sqrt", "sigmoid", "tanh", "floor", "round",
                  "sign", "log1p", "reciprocal", "relu", "square", "isnan", "frac", "rsqrt",
                  "logical_not", "bitwise_not", "trunc", "ceil", "erf", "signbit"]
            return f"{v} = {a}.{r.choice(fl)}()"
        b = self.pick() if r.random() < 0.6 else self.host() if r.random() < 0.2 else self.lit()
        if r.random() < 0.15:
            c = self.pick(lambda t: t.dtype == self.torch.bool) or f"{a} > 0"
            return f"{v} = torch.where({c}, {a}, {b})"
        if r.random() < 0.15:
            fn = r.choice(["maximum", "minimum", "atan2", "copysign", "xlogy", "fmod",
                           "remainder", "logical_and", "logical_xor", "hypot", "eq", "ne"])
            return f"{v} = torch.{fn}({a}, {b})"
        if r.random() < 0.1:
            return f"{v} = {a}.clamp(min={self.lit()}, max={self.lit()})"
        op = r.choice(["+", "-", "*", "/", "//", "%", "**", "<", ">=", "==", "&", "|", "^"])
        return f"{v} = {a} {op} {b}" if r.random() < 0.8 else f"{v} = {b} {op} {a}"

    def f_view(self):
        r, v = self.r, self.fresh()
        a = self.pick()
        if a is None:
            return None
        t = self.ns[a]
        nd = t.dim()
        opts = [f"{a}.unsqueeze({r.randint(-nd - 1, nd)})", f"{a}.view(-1)",
                f"{a}.reshape(-1)", f"{a}.flatten()", f"{a}.contiguous()", f"{a}.clone()",
                f"{a}.squeeze()"]
        if nd <= 2:
            opts.append(f"{a}.t()")
        if nd >= 1:
            d = self.dim(t)
            n = t.shape[d]
            s = r.randint(0, max(n - 1, 0))
            opts += [f"{a}[{r.choice(['1:', '::2', ':-1', '-1', '0', '...'])}]",
                     f"{a}.narrow({d}, {s}, {r.randint(0, max(n - s, 0))})",
                     f"{a}.select({d}, {r.randint(-n, n - 1) if n else 0})",
                     f"{a}.expand(2, *{a}.shape)", f"{a}.flip({d})",
                     f"{a}.movedim({d}, 0)"]
        if nd >= 2:
            p = list(range(nd))
            r.shuffle(p)
            opts += [f"{a}.mT", f"{a}.transpose(0, 1)", f"{a}.permute{tuple(p)}",
                     f"{a}[:, ::2]", f"{a}.diagonal()", f"{a}.mT[0]", f"{a}.unflatten(0, (1, -1))"]
        if nd >= 1:
            opts += [f"{a}.unfold(-1, {r.randint(1, 2)}, 1)", f"{a}.expand_as(torch.stack([{a}, {a}]))",
                     f"{a}.index_fill(0, {self.idx(t.shape[0])}, {self.lit()})",
                     f"{a}.masked_scatter({a} > 0, {a}.flip(0))", f"{a}.unbind(0)[0]",
                     f"{a}.view({a}.dtype)", f"{a}.split([1, {a}.shape[0] - 1])[1]"]
            if t.is_contiguous() and t.storage_offset() == 0:
                # within the tensor's own elements: past them, CPU's storage may be larger
                # than the tensor (an op's scratch), ours never is (bar run seed 6131201)
                opts.append(f"{a}.as_strided(({r.randint(0, (t.numel() + 1) // 2)},), (2,))")
        return f"{v} = {r.choice(opts)}"

    def f_inplace(self):
        r = self.r
        a = self.pick()
        if a is None:
            return None
        t = self.ns[a]
        b = self.pick() if r.random() < 0.5 else self.host() if r.random() < 0.2 else self.lit()
        opts = [f"{a}.add_({b})", f"{a}.mul_({b})", f"{a}.sub_({b})", f"{a}.div_({b})",
                f"{a}.clamp_(min={self.lit()})", f"{a}.zero_()", f"{a}.fill_({self.lit()})",
                f"{a}.neg_()", f"{a}.exp_()", f"{a}.pow_({r.choice(['2', 'False', '0.5'])})",
                f"{a} += {b}", f"{a} *= {b}", f"{a}.copy_({b})" if b.startswith("v") else f"{a}.zero_()",
                f"{a}.masked_fill_({a} > 0, {self.lit()})", f"{a}.abs_()",
                f"{a}.unsqueeze_(0)", f"{a}.t_()" if t.dim() <= 2 else f"{a}.squeeze_()"]
        if t.dim() >= 1:
            opts += [f"{a}[{r.choice(['0', '1:', '::2', '-1', '...'])}] = {b}",
                     f"{a}[{r.choice(['0', '1:', '::2'])}] += {self.lit()}",
                     f"{a}.mT.mul_({self.lit()})" if t.dim() >= 2 else f"{a}[:1].mul_(2)"]
        return r.choice(opts)

    def f_out(self):
        r = self.r
        a, o = self.pick(), self.pick()
        if a is None:
            return None
        b = self.pick() if r.random() < 0.5 else self.lit()
        # An out= tensor that overlaps an input is undefined behaviour in PyTorch (CPU itself
        # reads half-written memory): such a target is replaced by a fresh tensor. So is an
        # empty view of an input's storage: resized for the result, it overlaps the input
        # (CPU checks overlap before it resizes, so it computes through the overlap).
        st = lambda k: self.ns[k].untyped_storage()._cdata  # noqa: E731  (the storage itself)
        inputs = [x for x in (a, b) if x in self.ns and isinstance(self.ns[x], self.torch.Tensor)]
        if any(x == o or st(x) == st(o) for x in inputs):
            o = None
        target = o if o is not None and r.random() < 0.7 else \
            f"torch.empty({r.choice(['0', '(2, 2)', '1'])}, device=dev)"
        v = self.fresh()
        fn = r.choice([f"torch.add({a}, {b}, out={{}})", f"torch.mul({a}, {b}, out={{}})",
                       f"torch.neg({a}, out={{}})", f"torch.sum({a}, 0, out={{}})",
                       f"torch.exp({a}, out={{}})", f"torch.mm({a}, {a}.mT, out={{}})",
                       f"torch.where({a} > 0, {a}, {b}, out={{}})",
                       f"torch.clamp({a}, 0, 1, out={{}})", f"torch.cumsum({a}, 0, out={{}})"])
        if target.startswith("torch."):
            return f"{v} = " + fn.format(target)
        return fn.format(target)

    def _out_view(self, o):
        """A non-contiguous or offset view of `o` (or of a fresh zero tensor) as an out=."""
        r = self.r
        t = self.ns.get(o) if o else None
        if t is None or not isinstance(t, self.torch.Tensor) or t.dim() == 0 or not t.numel():
            base = r.choice(["torch.zeros(2, 3, device=dev)", "torch.zeros(9, device=dev)",
                             "torch.zeros(3, 4, device=dev, dtype=torch.int64)"])
            views = {"torch.zeros(2, 3, device=dev)": [".narrow(1, 1, 2)", "[:, ::2]", ".t()"],
                     "torch.zeros(9, device=dev)": ["[2:6]", "[::2]", "[1:]"],
                     "torch.zeros(3, 4, device=dev, dtype=torch.int64)":
                         ["[1:, 1:3]", ".t()[1:3]", "[:, ::3]"]}[base]
            return base + r.choice(views)
        d = r.randrange(t.dim())
        n = t.shape[d]
        return r.choice([f"{o}.narrow({d}, {min(1, n - 1)}, {max(n - 1, 0)})",
                         f"{o}.select({d}, {n - 1})" if t.dim() > 1 else f"{o}[{n - 1}:]",
                         f"{o}.mT" if t.dim() > 1 else f"{o}[::2]",
                         f"{o}[{'::2' if t.dim() == 1 else ':, ::2' if t.dim() == 2 else '..., ::2'}]",
                         f"{o}.flatten()[1:]" if t.is_contiguous() else f"{o}[1:]"])

    def f_outview(self):
        """Factories and out= ops writing into non-contiguous and offset views (issue 23: the
        values landed on the wrong elements, and a resize warning CPU does not give)."""
        r = self.r
        o = self.pick(lambda t: t.dtype in (self.torch.float32, self.torch.int64))
        tgt = self._out_view(o)
        # The input never shares the target's storage (as in `f_out`): an out= view that its
        # resize makes overlap the input is undefined behaviour, and CPU, checking overlap
        # before it resizes, computes through it a value its loop's vector width decides
        # (`torch.add(v.reshape(-1), 1, out=v.select(1, 1))`: [1, 2, 3, 4] from v's 4
        # elements 0, 1, 4, 9), where the device raises the overlap error (seed 22011389).
        st = o and self.ns[o].untyped_storage()._cdata
        a = self.pick(lambda t: t.dtype == self.torch.float32 and t.dim() == 1
                      and t.untyped_storage()._cdata != st)
        n = r.randint(0, 7)
        ops = [f"torch.arange({n}, out={tgt})", f"torch.arange(0., {n / 2}, 0.5, out={tgt})",
               f"torch.linspace(-1, {n}, {n}, out={tgt})",
               f"torch.logspace(0, 1, {n}, base={r.choice([2, 10])}, out={tgt})",
               f"torch.range(0, {n}, out={tgt})", f"torch.full(({n},), 3, out={tgt})",
               f"torch.zeros(({n},), out={tgt})", f"torch.ones({n}, out={tgt})",
               f"torch.eye({max(n // 2, 1)}, out={tgt})", f"torch.randperm({n}, out={tgt})"]
        if a is not None:
            ops += [f"torch.cat([{a}, {a}], out={tgt})", f"torch.add({a}, 1, out={tgt})",
                    f"torch.cumsum({a}, 0, out={tgt})"]
        return r.choice(ops)

    def f_intrng(self):
        """Integer RNG with from/to (issue 23): exact draws, CPU's bound errors and warnings."""
        r, v = self.r, self.fresh()
        dt = r.choice(["int32", "uint32", "int64", "int16", "uint8", "int8", "float32"])
        big = [0, 1, 2**24 + 1, 2**31 - 1, 2**31, 2**32, -2**31, -42, 255, 256]
        lo, hi = sorted(r.sample(big, 2))
        shape = self.shape()
        if r.random() < 0.5:
            return f"{v} = torch.empty({shape}, dtype=torch.{dt}, device=dev).random_({lo}, {hi})"
        a = self.pick(lambda t: not t.is_floating_point() and t.dtype != self.torch.bool
                      and not t.is_complex())
        if a is not None and r.random() < 0.5:
            return f"{a}.random_({r.choice([hi, lo + 1])})" if r.random() < 0.3 else \
                f"{a}.random_({lo}, {hi})"
        return f"{v} = torch.randint({lo}, {hi}, {shape}, dtype=torch.{dt}, device=dev)"

    def f_storage(self):
        """storage() identity and size (issue 23): as a tensor, so runs compare it."""
        r, v = self.r, self.fresh()
        a, b = self.pick(), self.pick()
        if a is None:
            return None
        # (device tensors, as every variable: a host one would meet CUDA's device rule)
        return r.choice([
            f"{v} = torch.tensor({a}.storage().data_ptr() == {b}.storage().data_ptr(), "
            f"device=dev)",
            f"{v} = torch.tensor({a}.untyped_storage().data_ptr() == "
            f"{b}.untyped_storage().data_ptr(), device=dev)",
            # (the size an op's result gets is its kernel's: CPU's mse_loss leaves a 2-element
            # storage under a 0-dim result; what holds everywhere is that it covers the tensor)
            f"{v} = torch.tensor([{a}.storage().size() >= {a}.storage_offset() + sum("
            f"(n - 1) * abs(s) for n, s in zip({a}.shape, {a}.stride())) + ({a}.numel() > 0), "
            f"{a}.storage().element_size()], device=dev)",
            # (its own first element: the rest of a storage may never have been written)
            f"{v} = torch.tensor({a}.storage().tolist()[{a}.storage_offset():][:1], device=dev)"
            if self.ns[a].numel() and self.ns[a].dtype != self.torch.bool else None,
        ])

    def f_dtype(self):
        r, v = self.r, self.fresh()
        a = self.pick()
        if a is None:
            return None
        dt = r.choice(["float32", "float64", "int64", "int32", "bool", "uint8", "int16"])
        return f"{v} = " + r.choice([f"{a}.to(torch.{dt})", f"{a}.float()", f"{a}.double()",
                                     f"{a}.long()", f"{a}.bool()", f"{a}.int()",
                                     f"torch.zeros_like({a}, dtype=torch.{dt})",
                                     f"{a}.type_as({self.pick()})",
                                     f"torch.ones({self.shape()}, dtype=torch.{dt}, device=dev)"])

    def f_reduce(self):
        r, v = self.r, self.fresh()
        a = self.pick()
        if a is None:
            return None
        t = self.ns[a]
        d = self.dim(t)
        opts = [f"{a}.sum()", f"{a}.sum({d})", f"{a}.sum({d}, keepdim=True)", f"{a}.mean()",
                f"{a}.mean({d})", f"{a}.amax({d})", f"{a}.max({d}).values", f"{a}.max({d})[1]",
                f"{a}.argmax()", f"{a}.prod({d})", f"{a}.std({d})", f"{a}.var()",
                f"{a}.logsumexp({d})", f"{a}.cumsum({d})", f"{a}.any()", f"{a}.all({d})",
                f"{a}.norm()", f"{a}.softmax({d})", f"{a}.log_softmax({d})",
                f"torch.count_nonzero({a})", f"{a}.min()", f"{a}.sort({d}).values",
                f"{a}.topk(1, {d}).indices", f"{a}.sum(dtype=torch.float64)", f"{a}.aminmax()[0]",
                f"{a}.cummax({d}).values", f"{a}.median()"]
        return f"{v} = {r.choice(opts)}"

    def f_matmul(self):
        r, v = self.r, self.fresh()
        a = self.pick(lambda t: t.dim() >= 1)
        if a is None:
            return None
        t = self.ns[a]
        b = self.pick(lambda u: u.dim() >= 1 and u.shape[-1:] == t.shape[-1:]) or a
        opts = [f"{a} @ {a}.mT" if t.dim() >= 2 else f"{a} @ {a}",
                f"{a}.mT @ {a}" if t.dim() >= 2 else f"torch.dot({a}, {b})",
                f"torch.matmul({a}, {b}.mT)" if self.ns[b].dim() >= 2 else f"torch.matmul({a}, {b})",
                f"F.linear({a}, {b})", f"{a} @ {b}", f"torch.mm({a}, {b})",
                f"torch.bmm({a}, {a}.mT)", f"torch.einsum('...i,...i->...', {a}, {b})",
                f"torch.mv({a}, {b})", f"torch.addmm({b}, {a}, {a}.mT)"]
        return f"{v} = {r.choice(opts)}"

    def f_index(self):
        r, v = self.r, self.fresh()
        a = self.pick(lambda t: t.dim() >= 1)
        if a is None:
            return None
        t = self.ns[a]
        n = t.shape[0]
        ix = self.idx(n)
        src = self.pick()
        opts = [f"{v} = {a}.index_select(0, {ix})", f"{v} = {a}[{ix}]",
                f"{v} = {a}[{a} > 0]", f"{v} = torch.nonzero({a})", f"{v} = torch.argwhere({a})",
                f"{v} = torch.where({a} > 0)[0]", f"{v} = {a}.masked_fill({a} < 0, {self.lit()})",
                f"{v} = {a}.take({self.idx(t.numel())})", f"{v} = {a}.masked_select({a} != 0)",
                f"{a}.index_put_(({ix},), torch.tensor({self.lit()}, device=dev))",
                f"{v} = {a}.index_put(({ix},), {src}, accumulate=True)",
                f"{v} = {a}.mT[{ix}]" if t.dim() >= 2 else f"{v} = {a}[{ix}]",
                f"{a}.index_add_(0, {ix}, {src})", f"{a}.index_copy_(0, {ix}, {src})",
                f"{v} = {a}.gather(0, {ix})" if t.dim() == 1 else f"{v} = {a}[..., 0]",
                f"{a}[{ix}] = {self.lit()}", f"{v} = torch.nonzero({a}).flatten()"]
        return r.choice(opts)

    def f_scatter(self):
        r, v = self.r, self.fresh()
        a = self.pick(lambda t: t.dim() >= 1)
        if a is None:
            return None
        t = self.ns[a]
        n = t.shape[0]
        k = r.randint(1, 3)
        ix = self.idx(n, k)
        src = self.pick() or a
        shp = (k,) + tuple(t.shape[1:])
        ixf = f"{ix}.view(-1, *[1] * ({a}.dim() - 1)).expand({shp})"
        opts = [f"{v} = {a}.scatter(0, {ixf}, {self.lit()})",
                f"{v} = {a}.scatter_add(0, {ixf}, {src})",
                f"{v} = {a}.scatter_reduce(0, {ixf}, {src}, '{r.choice(['sum', 'amax', 'amin', 'prod', 'mean'])}')",
                f"{a}.scatter_(0, {ixf}, {src})", f"{v} = {a}.gather(0, {ixf})"]
        return r.choice(opts)

    def f_random(self):
        r, v = self.r, self.fresh()
        a = self.pick()
        opts = [f"torch.manual_seed({r.randint(0, 99)})", f"{v} = torch.rand({self.shape()}, device=dev)",
                f"{v} = torch.randn({self.shape()}, dtype=torch.float64, device=dev)",
                f"{v} = torch.randint(0, 5, {self.shape()}, device=dev)",
                f"{v} = torch.randperm({r.randint(0, 6)}, device=dev)"]
        if a is not None:
            opts += [f"{v} = torch.rand_like({a})", f"{v} = F.dropout({a}, {r.choice([0.0, 0.5, 1.0])})",
                     f"{v} = torch.bernoulli({a}.sigmoid())", f"{a}.uniform_()", f"{a}.normal_()",
                     f"{v} = torch.randn_like({a})"]
            if self.ns[a].numel():  # CPU's native_dropout hands an empty input back as its
                # output, so autograd makes that input a non-leaf (seed 19008469): a quirk of
                # CPU's kernel, not of the op (the device returns a new empty tensor)
                opts.append(f"{v} = torch.native_dropout({a}, {r.choice([0.0, 0.3, 1.0])}, "
                            f"{r.choice([True, False, None])})[0]")
        return r.choice(opts)

    def f_shape(self):
        r, v = self.r, self.fresh()
        a = self.pick()
        if a is None:
            return None
        b = self.pick() or a
        t = self.ns[a]
        opts = [f"torch.cat([{a}, {b}])", f"torch.stack([{a}, {b}])", f"{a}.repeat(2, *[1] * {a}.dim())",
                f"torch.cat([{a}, {a}], -1)"]
        if t.dim() >= 1:
            opts += [f"{a}.chunk(2)[0]", f"{a}.split(1)[-1]", f"{a}.roll(1, 0)", f"{a}.flip(-1)"]
        if t.dim() >= 2:
            opts += [f"{a}.tril()", f"{a}.triu(1)"]
        return f"{v} = {r.choice(opts)}"

    def f_nn(self):
        r, v = self.r, self.fresh()
        a = self.pick()
        if a is None:
            return None
        b = self.pick() or a
        # a 0-d target: PyTorch's nll_loss_nd reads sizes()[0] of it (past its sizes, so
        # CPU's error depends on memory; bar run seed 7113226)
        t = b if self.ns[b].dim() else f"{b}.reshape(1)"
        opts = [f"F.gelu({a})", f"F.logsigmoid({a})", f"F.mse_loss({a}, {b})", f"F.silu({a})",
                f"F.layer_norm({a}, {a}.shape[-1:])", f"F.leaky_relu({a})", f"F.softplus({a})",
                f"F.normalize({a}, dim=-1)", f"F.relu6({a})", f"F.hardtanh({a})",
                f"F.cross_entropy({a}, {t})", f"F.embedding({b}, {a})",
                f"F.cross_entropy({a}, {t}, label_smoothing=0.1)", f"F.pad({a}, (1, 2))",
                f"F.scaled_dot_product_attention({a}, {a}, {b})",
                f"F.scaled_dot_product_attention({a}, {b}, {b}, is_causal=True)",
                f"F.group_norm({a}, 1)", f"F.batch_norm({a}, None, None, training=True)",
                f"F.conv1d({a}, torch.ones(2, {a}.shape[1], 2, device=dev))",
                f"F.avg_pool1d({a}, 2)", f"F.interpolate({a}, scale_factor=2)",
                f"F.one_hot({a}.long().abs(), 6)", f"F.glu({a}, -1)",
                f"F.softmax({a}, -1, dtype=torch.float32)", f"F.dropout({a}, 0.0)",
                f"F.grid_sample({a}.reshape(1, 1, -1, 1), torch.linspace(-1.2, 1.2, 12, "
                f"device=dev).reshape(1, 2, 3, 2).to({a}.dtype), "
                f"mode={r.choice(['bilinear', 'nearest', 'bicubic'])!r}, "
                f"padding_mode={r.choice(['zeros', 'border', 'reflection'])!r}, "
                f"align_corners={r.random() < 0.5})",
                f"F.hardswish({a})", f"F.elu({a})", f"F.softplus({a}, beta=2.0)",
                f"F.interpolate({a}.reshape(1, 1, -1), size=5, mode='linear')",
                f"F.pad({a}.reshape(1, 1, -1), (1, 1), mode='reflect')",
                f"F.pad({a}.reshape(1, 1, -1), (2, 0), mode='replicate')",
                f"F.binary_cross_entropy_with_logits({a}, {b})", f"F.smooth_l1_loss({a}, {b})",
                f"F.hardshrink({a})", f"F.softshrink({a}, 0.3)",
                f"F.embedding_bag(torch.arange(5, device=dev) % max({a}.shape[0], 1), {a}, "
                f"torch.tensor([0, 2], device=dev), mode={r.choice(['sum', 'mean', 'max'])!r})",
                # targets stop at the first -1 (graphs hold a decomposition of this loss:
                # Note [Wrong decompositions in graphs])
                f"F.multilabel_margin_loss({a}.reshape(1, -1), torch.where(torch.arange("
                f"{a}.numel(), device=dev) == {r.randrange(4)}, -1, {a}.detach().reshape(1, -1)"
                f".float().argsort(-1)), reduction={r.choice(['mean', 'sum', 'none'])!r})"]
        return f"{v} = {r.choice(opts)}"

    def f_autograd(self):
        r = self.r
        leaves = self.vars(lambda t: t.requires_grad)
        if leaves and r.random() < 0.6:
            a = self.pick(lambda t: t.requires_grad and t.is_floating_point())
            if a is None:
                return None
            return r.choice([f"{a}.sum().backward()", f"{a}.backward(torch.ones_like({a}))",
                             f"{a}.pow(2).mean().backward()", f"F.mse_loss({a}, torch.zeros_like({a})).backward()",
                             f"F.logsigmoid({a}).sum().backward()"])
        a = self.pick(lambda t: t.is_floating_point() and not t.is_complex() and t.numel() <= 64)
        if a is not None and r.random() < 0.2:  # torch.func's transforms (their own wrappers)
            v = self.fresh()
            fns = [f"torch.func.grad(lambda u: (u.sin() * u).sum())({a})",
                   f"torch.func.jvp(lambda u: u.exp() * 2 - u, ({a},), (torch.ones_like({a}),))[1]",
                   f"torch.func.vjp(lambda u: u.tanh() * u, {a})[1](torch.ones_like({a}))[0]",
                   f"torch.func.jacrev(lambda u: u.sigmoid() * u.sum())({a})",
                   f"torch.func.jacfwd(lambda u: u.cos() + u.mean())({a})",
                   f"torch.func.hessian(lambda u: (u ** 3).sum())({a})"]
            if self.ns[a].dim() >= 1:
                fns.append(f"torch.func.vmap(lambda u: u * 2 + u.sum())({a})")
            return f"{v} = {r.choice(fns)}"
        a = self.pick(lambda t: t.is_floating_point() and t.dim() >= 1)
        if a is not None and r.random() < 0.25:  # a composite view of it written in inference
            view = r.choice(["reshape(-1)", "flatten()", "movedim(0, -1)",  # mode: autograd's
                             f"expand_as({a})", "narrow(0, 0, 1)"])  # view, version and all
            return f"with torch.inference_mode(): {a}.{view}.mul_(2)"
        a = self.pick()
        if a is None:
            return None
        v = self.fresh()
        return f"{v} = {a}.detach().{r.choice(['float', 'double'])}().requires_grad_()"

    def f_optim(self):
        """What optimizers run: fused multiply-adds, foreach ops over lists, and real steps
        (on CPU a for-loop over tensors, on a device the foreach kernels)."""
        r = self.r
        fl = lambda t: t.is_floating_point()  # noqa: E731
        a = self.pick(fl)
        if a is None:
            return None
        t = self.ns[a]
        same = lambda u: u.is_floating_point() and u.shape == t.shape  # noqa: E731
        b, c = self.pick(same) or a, self.pick(same) or a
        leaves = self.vars(lambda u: _grad_leaf(u) and u.grad is not None)
        if leaves and r.random() < 0.3:
            ps = ", ".join(r.sample(leaves, r.randint(1, min(2, len(leaves)))))
            opt = r.choice(["SGD([{}], lr=0.1)", "SGD([{}], lr=0.1, momentum=0.9, nesterov=True)",
                            "Adam([{}], lr=0.01)", "AdamW([{}], lr=0.01, weight_decay=0.1)",
                            "AdamW([{}], lr=0.01, amsgrad=True)", "RMSprop([{}], lr=0.01)",
                            "Adagrad([{}], lr=0.1)"])
            return f"torch.optim.{opt.format(ps)}.step()"
        v = self.fresh()
        opts = [f"{a}.addcmul_({b}, {c}, value={self.lit()})",
                f"{a}.addcdiv_({b}, {c}.abs() + 1, value=0.1)", f"{a}.lerp_({b}, 0.1)",
                f"torch._foreach_add_([{a}, {b}], [{c}, {c}], alpha=0.5)",
                f"torch._foreach_mul_([{a}, {b}], {self.lit()})",
                f"torch._foreach_lerp_([{a}], [{b}], 0.1)",
                f"torch._foreach_addcdiv_([{a}], [{b}], [{c}.abs() + 1], 0.1)",
                f"torch._foreach_sqrt_([{a}])", f"{v} = torch._foreach_sqrt([{a}, {b}])[0]",
                f"{v} = torch._foreach_norm([{a}, {b}])[{r.randint(0, 1)}]",
                f"{v} = torch._foreach_maximum([{a}], [{b}])[0]",
                f"{v} = torch.stack(torch._foreach_abs([{a}, {b}]))"]
        zero_d = lambda u: u.dim() == 0 and u.dtype == self.torch.float32  # noqa: E731
        scalar = self.pick(zero_d)
        if scalar is not None:  # GradScaler's unscale_ and update
            found = self.pick(zero_d)
            opts += [f"torch._amp_foreach_non_finite_check_and_unscale_([{a}, {b}], {found}, "
                     f"{scalar})",
                     f"torch._amp_update_scale_({scalar}, torch.zeros((), dtype=torch.int32, "
                     f"device=dev), {found}, 2.0, 0.5, {r.randint(1, 3)})"]
        return r.choice(opts)

    def f_lowp(self):
        """bfloat16 and float16: models run in them (`.to(torch.bfloat16)`, autocast)."""
        r, v = self.r, self.fresh()
        a = self.pick()
        if a is None:
            return None
        dt = r.choice(["bfloat16", "float16"])
        b = self.pick() or a
        return f"{v} = " + r.choice([f"{a}.to(torch.{dt})", f"{a}.to(torch.{dt})",
                                     f"torch.randn({self.shape()}, dtype=torch.{dt}, device=dev)",
                                     f"{a}.to(torch.{dt}) + {b}",
                                     f"{a}.to(torch.{dt}).sum()",
                                     f"{a}.to(torch.{dt}).softmax(-1)" if self.ns[a].dim() else
                                     f"{a}.to(torch.{dt}).exp()",
                                     f"F.linear({a}.to(torch.{dt}), {a}.to(torch.{dt}))"
                                     if self.ns[a].dim() >= 1 else f"{a}.to(torch.{dt}).neg()"])

    def f_complex(self):
        """complex64: conjugate views (materialized on the device) and CPU kernels that
        conjugate lazily inside (Note [CPU kernels inside dispatch])."""
        r, v, torch = self.r, self.fresh(), self.torch
        z = self.pick(lambda t: t.is_complex())
        if z is None or r.random() < 0.25:
            a = self.pick(lambda t: t.is_floating_point() and t.dtype != torch.float64)
            if a is None:
                return None
            return f"{v} = " + r.choice([f"{a}.to(torch.complex64)", f"{a} * 1j + {a}",
                                         f"torch.complex({a}, {a}.neg())"])
        t = self.ns[z]
        # (never a bare conjugate view as a variable: on the device it is a copy, not a view
        # to write through, a documented gap; resolve_conj() is a copy on both)
        ops = [f"{z}.conj().resolve_conj()", f"{z}.conj().abs()", f"{z}.angle()",
               f"{z} * {z}.conj()",
               f"({z}.conj() + 1).imag", f"torch.view_as_real({z}.conj().resolve_conj())",
               f"{z}.conj().sum()", f"torch.where({z}.real > 0, {z}, {z}.conj())"]
        if t.dim() >= 1:
            ops += [f"torch.fft.fft({z})", f"{z}.conj().flip(0)"]
        if t.dim() == 2:
            n = t.shape[0]
            ops += [f"{z}.mH @ {z}", f"{z} @ {z}.mH", f"torch.linalg.pinv({z})",
                    f"{z}.mH.resolve_conj()"]
            if t.shape[0] == t.shape[1]:
                ops += [f"torch.linalg.solve({z} + 3 * torch.eye({n}, device=dev), {z}, "
                        f"left=False)"]
        return f"{v} = " + r.choice(ops)

    def f_linalg(self):
        """LAPACK and the FFTs (Note [Linear algebra on the device]): factorizations of a
        well-conditioned matrix made from a variable (float32: float64 ones would compare a
        float32 factorization with CPU's float64 one), and a singular one, whose error CPU
        raises at the call."""
        r, v, torch = self.r, self.fresh(), self.torch
        a = self.pick(lambda t: t.dtype == torch.float32 and t.dim() >= 1 and t.numel() > 0)
        if a is None:
            return None
        t = self.ns[a]
        n = t.shape[-1]
        m = f"{a}.reshape(-1, {n})"
        s = f"({m}.mT @ {m} + {n} * torch.eye({n}, device=dev))"  # symmetric positive definite
        ops = [f"torch.linalg.inv({s})", f"torch.linalg.cholesky({s})",
               f"torch.linalg.eigvalsh({s})", f"torch.linalg.eigh({s}).eigenvectors.abs()",
               f"torch.linalg.solve({s}, {m}.mT)", f"torch.linalg.slogdet({s}).logabsdet",
               f"torch.linalg.lu_factor({s}).LU", f"torch.linalg.qr({m}).R.abs()",
               f"torch.linalg.svdvals({m})", f"torch.cholesky_solve({m}.mT, torch.linalg.cholesky({s}))",
               f"torch.linalg.solve_triangular(torch.linalg.cholesky({s}), {m}.mT, upper=False)",
               f"torch.linalg.inv_ex({s}).inverse + {a}.sum()", f"torch.linalg.det({s} / {n})",
               f"torch.linalg.inv({m}.mT @ {m} * 0)",  # singular: CPU's LinAlgError at the call
               f"torch.fft.irfft(torch.fft.rfft({a}) * 0.5, n={n})",
               f"torch.view_as_real(torch.fft.fft({a}.to(torch.complex64)))",
               f"torch.fft.rfft({a}).abs()", f"torch.fft.ifft(torch.fft.fft({a})).real"]
        if t.dim() >= 2:
            ops += [f"torch.fft.fft2({a}).abs()", f"torch.fft.irfftn(torch.fft.rfftn({a}, "
                    f"dim=(0, -1)), {a}.shape[::{t.dim() - 1}], dim=(0, -1))"]
        return f"{v} = " + r.choice(ops)

    def f_settings(self):
        """CPU settings the host's kernels read, changed between ops (Note [CPU settings]):
        a queued op must compute under the settings of its call. Values near the denormal
        range make flush-to-zero show."""
        r = self.r
        # (not of float64: computed as float32 there, 1e-39 would be denormal on the device
        # only, the documented float64 policy)
        a = self.pick(lambda t: t.is_floating_point() and t.dtype != self.torch.float64)
        if a is not None and r.random() < 0.3:
            return f"{self.fresh()} = {a} * 1e-39"
        return r.choice(["torch.set_flush_denormal(True)", "torch.set_flush_denormal(False)",
                         "torch.set_num_threads(1)", "torch.set_num_threads(2)",
                         "torch.set_float32_matmul_precision('medium')",
                         "torch.set_float32_matmul_precision('highest')"])

    # Note [Edge values]: the "edge" family's values: each integer type's limits (but int32's
    # and int64's minimum: INT_MIN // -1 kills CPU's process with SIGFPE, LIMITS), non-finite
    # and extreme floats (denormals, float32's and float16's maxima), in every dtype.
    EDGE_INTS = {"int8": [127, -128, 100, -1, 0], "uint8": [255, 0, 1, 128, 200],
                 "int16": [32767, -32768, 300, -1, 0], "int32": [2**31 - 1, -2**31 + 1, 2**16, -1],
                 "int64": [2**63 - 1, -2**63 + 1, 2**40, -7]}
    EDGE_FLOATS = ["float('inf')", "-float('inf')", "float('nan')", "0.0", "-0.0", "3e38", "-3e38",
                   "1e-45", "-1e-40", "65504.0", "7e4", "1.5", "-2.5"]

    def f_edge(self):
        """Edge values, integer overflow and type promotion (Note [Edge values]): integer
        tensors at their limits wrapping in arithmetic, reductions and casts; NaN, infinities,
        -0.0, denormals and float32/float16 saturation through pointwise ops, reductions and
        sorts; 0-d and 1-element tensors of every dtype (device and host) and Python scalars
        out of a dtype's range as operands, where the result type comes from PyTorch's
        promotion rules (a 0-d operand counts only when of a higher category)."""
        r, v, torch = self.r, self.fresh(), self.torch
        k = r.random()
        if k < 0.3:  # a tensor of edge values
            if r.random() < 0.5:
                dt = r.choice(list(self.EDGE_INTS))
                vals = r.sample(self.EDGE_INTS[dt], r.randint(1, len(self.EDGE_INTS[dt])))
                return f"{v} = torch.tensor({vals}, dtype=torch.{dt}, device=dev)"
            vals = r.sample(self.EDGE_FLOATS, r.randint(1, 6))
            dt = r.choice(["float32", "float32", "float16", "bfloat16"])
            shape = r.choice(["", "", ".reshape(-1, 1)", ".flip(0)"])
            return f"{v} = torch.tensor([{', '.join(vals)}], dtype=torch.{dt}, device=dev){shape}"
        a = self.pick(lambda t: not t.is_complex())
        if a is None:
            return None
        t = self.ns[a]
        ints = not t.is_floating_point() and t.dtype != torch.bool
        if k < 0.6:  # an operand of another dtype: 0-d or 1-element, device or host; a scalar
            dt = r.choice(["bool", "uint8", "int8", "int16", "int32", "int64", "float16",
                           "bfloat16", "float32", "float64"])
            lit = r.choice(["0", "1", "-1", "3", "200", "-129", "300", "2.5", "-0.0",
                            "float('inf')", "float('nan')", "1e5", "2**31", "2**40"])
            operand = r.choice([f"torch.tensor({lit}, dtype=torch.{dt}, device=dev)",
                                f"torch.tensor({lit}, dtype=torch.{dt})",
                                f"torch.tensor([{lit}], dtype=torch.{dt}, device=dev)", lit])
            op = r.choice(["+", "-", "*", "/", "<", ">", "==", "!=", ">=", "&", "|", "^"])
            fn = r.choice(["torch.maximum", "torch.minimum", "torch.where",
                           "torch.clamp", "torch.add", "torch.mul", "torch.eq"])
            if r.random() < 0.3:
                if fn == "torch.where":
                    return f"{v} = torch.where({a} > 0, {a}, {operand})"
                if fn == "torch.clamp":
                    return f"{v} = torch.clamp({a}, max={operand})"
                if fn in ("torch.add", "torch.mul"):
                    return f"{v} = {fn}({a}, {operand}, alpha={r.choice([2, 3])})" \
                        if fn == "torch.add" else f"{v} = {fn}({operand}, {a})"
                return f"{v} = {fn}({a}, {operand})"
            if r.random() < 0.2:  # in place: the result type must cast to the tensor's own
                return f"{a}.{r.choice(['add_', 'mul_', 'sub_', 'clamp_'])}({operand})"
            return f"{v} = {a} {op} {operand}" if r.random() < 0.7 else f"{v} = {operand} {op} {a}"
        if ints:  # overflow: wraps as on CPU, in arithmetic, accumulation and casts
            ops = [f"{a} * {a}", f"{a} + {a}", f"{a} * 3", f"{a} - 1", f"-{a}", f"{a}.abs()",
                   f"{a} << {r.choice([1, 3, 7, 9, 31, 40, 70])}",
                   f"{a} >> {r.choice([1, 7, 9, 63, 70])}", f"~{a}", f"{a} ** 2", f"{a}.pow(3)",
                   f"{a}.sum()", f"{a}.sum(dtype=torch.{r.choice(['int8', 'int16', 'uint8'])})",
                   f"{a}.cumsum(0, dtype=torch.{r.choice(['int8', 'int32'])})"
                   if t.dim() else f"{a}.cumsum(0)",
                   f"{a}.prod()", f"{a}.to(torch.{r.choice(['int8', 'uint8', 'int16', 'int32'])})",
                   f"{a}.float()", f"{a}.half()", f"{a}.to(torch.bfloat16)", f"{a}.double()",
                   f"{a}.mean(dtype=torch.float32)", f"{a}.max()", f"{a}.sort(0).values"
                   if t.dim() else f"{a}.min()", f"{a}.argmax()", f"{a}.sign()",
                   # (divisors never 0 or -1: CPU's INT_MIN // -1 is SIGFPE)
                   f"{a} // {r.choice([3, -2, 7])}", f"{a} % {r.choice([3, -2, 7])}",
                   f"torch.fmod({a}, {r.choice([3, -2])})",
                   f"torch.div({a}, {r.choice([3, -2])}, rounding_mode={r.choice(['trunc', 'floor'])!r})",
                   f"{a} / {r.choice([3, -2])}", f"{a}.bitwise_and(0x0F)", f"{a}.clamp(-100, 100)"]
            return f"{v} = {r.choice(ops)}"
        # non-finite and extreme floats (casts to integers only of values within range: a
        # float beyond an integer type's range converts by C++'s undefined behaviour)
        ops = [f"{a}.exp()", f"{a} * 0", f"{a} - {a}", f"{a}.reciprocal()", f"{a}.sqrt()",
               f"{a}.log()", f"{a} * 1e30", f"{a}.square()", f"{a}.sign()", f"{a}.round()",
               f"{a}.floor()", f"{a}.pow(0)", f"{a} ** 0.5", f"{a}.nan_to_num()",
               f"{a}.nan_to_num(nan=1.0, posinf=2.0, neginf=-2.0)", f"{a}.isinf()",
               f"{a}.isfinite()", f"{a}.isnan()", f"{a}.signbit()", f"{a}.copysign(-1)",
               f"{a}.clamp(-1, 1)", f"{a}.clamp(min=0)", f"torch.fmax({a}, {a}.flip(-1))",
               f"torch.maximum({a}, {a}.flip(-1))", f"{a}.sum()", f"{a}.mean()", f"{a}.nansum()",
               f"{a}.amax()", f"{a}.min()", f"{a}.argmax()", f"{a}.argmin()", f"{a}.prod()",
               f"{a}.softmax(-1)", f"{a}.logsumexp(-1)", f"{a}.cumsum(-1)", f"{a}.norm()",
               f"{a}.half()", f"{a}.bfloat16()", f"{a}.float()", f"{a}.bool()",
               f"{a}.nan_to_num().clamp(-100, 100).to(torch.{r.choice(['int8', 'uint8', 'int32'])})",
               f"{a}.sigmoid()", f"{a}.tanh()", f"F.relu({a})", f"{a}.atan2({a})",
               f"torch.hypot({a}, {a})", f"{a}.frac()", f"{a}.trunc()", f"{a} // 1",
               f"{a} % 2", f"torch.nextafter({a}, {a}.flip(-1))", f"{a}.isposinf()"]
        if t.dim():
            ops += [f"{a}.sort(-1).values", f"{a}.sort(-1, descending=True).indices",
                    f"{a}.topk(1).values", f"{a}.cummax(-1).indices", f"{a}.max(-1).indices",
                    f"{a}.msort()", f"{a}.median(-1).values", f"{a}.nanmean(-1)"]
        return f"{v} = {r.choice(ops)}"

    def f_cores(self):
        """Several cores (Note [Cores] in adaptive_eager/integration/neuron.py): values copied
        to cores 1-3 (`dev1`..`dev3`, all "cpu" in the reference) and back, worked on there
        (in place too, through views), copied into and out of in both directions while each
        core's queue holds work. Copies are `.to(..., copy=True)`: on CPU `.to("cpu")` is the
        tensor itself, across cores a copy. A variable on core k is read only by this family,
        and only with others on core k (an op mixing cores raises CUDA's error)."""
        r, v = self.r, self.fresh()
        k = r.randint(1, 3)
        remote = [x for x in self.ns if self.core.get(x, 0) and x in self.ns
                  and isinstance(self.ns[x], self.torch.Tensor)]
        if not remote or r.random() < 0.3:
            a = self.pick()
            if a is None:
                return None
            self.pending_core = (v, k)
            return f"{v} = {a}{r.choice(['', '', '.mT', '[1:]', '[..., ::2]'][:5 if self.ns[a].dim() >= 2 else 2 if self.ns[a].dim() == 0 else 4])}" \
                   f".to(dev{k}, {r.choice(['', 'torch.float16, ', 'non_blocking=True, '])}copy=True)"
        x = r.choice(remote)
        k = self.core[x]
        t = self.ns[x]
        same = [y for y in remote if self.core[y] == k]
        y = r.choice(same)
        a = self.pick()
        back = r.random()
        if back < 0.25:  # back to core 0, or on to another core
            j = r.choice([0, 0, 1, 2, 3])
            if j:
                self.pending_core = (v, j)
            return f"{v} = {x}.to(dev{j or ''}, copy=True)"
        if back < 0.4 and a is not None:  # a copy across cores into a view of either side
            tgt = r.choice([x, f"{x}[1:]", f"{x}.mT"] if t.dim() >= 2 else [x, f"{x}[1:]"]
                           if t.dim() else [x])
            if r.random() < 0.5:
                return f"{tgt}.copy_({a})"
            return f"{a}{r.choice(['', '[1:]'] if self.ns[a].dim() else [''])}.copy_({x})"
        self.pending_core = (v, k)
        ops = [f"{v} = {x} * 2 + {y}", f"{v} = {x}.sum(0)" if t.dim() else f"{v} = {x} - 1",
               f"{x}.mul_({r.choice(['2', '-1', '0.5'])})", f"{x}.add_({y})",
               f"{v} = {x}.mT" if t.dim() >= 2 else f"{v} = {x}.view(-1)",
               f"{v} = {x}[1:]" if t.dim() else f"{v} = {x}.unsqueeze(0)",
               f"{x}[...] = {r.choice(['1.5', '0', '-2'])}", f"{v} = torch.where({x} > 0, {x}, {y})",
               f"{v} = {x}.float().softmax(-1)" if t.dim() else f"{v} = {x}.exp()",
               f"{v} = torch.ones_like({x}) + {x}", f"{v} = {x}.clone()",
               f"{v} = {x}.to(torch.int64)"]
        code = r.choice(ops)
        if not code.startswith(f"{v} ="):
            self.pending_core = None
        return code

    def f_alias(self):
        """Storage sharing made other ways than by view ops (Note [set_] in
        adaptive_eager/engine/storage.py): `set_` onto another tensor or a window of its
        storage, `.data =` (the tensor takes another's buffer and layout; its views keep the
        old one), reinterpreting views (`view(dtype)` of another element size,
        `view_as_real`/`view_as_complex`) written through, and `as_strided` of an offset view
        (its offset is absolute in the storage)."""
        r, v, torch = self.r, self.fresh(), self.torch
        a = self.pick(lambda t: not t.is_complex())
        if a is None:
            return None
        t = self.ns[a]
        b = self.pick(lambda u: u.dtype == t.dtype) or a
        # (windows of a storage only within elements a tensor covers: past them (an empty
        # out= target resized smaller, a kernel's scratch) its memory was never written)
        exact = lambda u: u.is_contiguous() and u.storage_offset() == 0 and (  # noqa: E731
            u.untyped_storage().nbytes() == u.numel() * u.element_size())
        n = t.numel() if exact(t) else 0
        ops = [f"{a}.set_({b})", f"{a}.data = {b}", f"{a}.data = {b}.mT" if self.ns[b].dim() >= 2
               else f"{a}.data = {b}.flip(0) if {b}.dim() else {b}.clone()",
               f"{v} = {a}.view(torch.{r.choice(['int32', 'int16', 'uint8'])})"
               if t.dtype == torch.float32 else f"{v} = {a}.view(torch.{t.dtype}) * 1".replace(
                   "torch.torch.", "torch."),
               f"{a}.view(torch.int32).bitwise_xor_(1)" if t.dtype == torch.float32 else
               f"{a}.view(-1)[:1].zero_()" if t.is_contiguous() else f"{a}.zero_()"]
        if n >= 2:
            k = r.randint(1, n - 1)
            m = r.randint(0, (n - k))
            ops += [f"{a}.set_({b}.untyped_storage(), {k}, ({m},), (1,))" if exact(self.ns[b])
                    and self.ns[b].numel() == n else f"{a}.set_({a}.untyped_storage(), {k}, ({m},), (1,))",
                    f"{v} = {a}[1:].as_strided(({max(m // 2, 0)}, 2), (1, 1), {k})"
                    if t.dim() >= 1 and m >= 2 else f"{v} = {a}.view(-1)",
                    f"{a}[1:].as_strided(({m},), (1,), {k}).mul_(3)" if t.dim() >= 1
                    else f"{a}.mul_(3)"]
        if t.dtype == torch.float32 and t.dim() >= 1 and t.shape[-1] == 2 and t.stride(-1) == 1:
            ops += [f"torch.view_as_complex({a}).mul_(1j)", f"{v} = torch.view_as_complex({a})"
                    f".conj().resolve_conj()"]
        return r.choice(ops)

    def f_custom(self):
        """Users' custom ops (`_fz`): a neuron kernel runs over the host memory of the device
        buffers as a launch of its own, among queued ops; one without falls back to CPU. Over
        views, non-contiguous and offset, as inputs and as the tensors written."""
        r, v = self.r, self.fresh()
        a = self.pick(lambda t: t.is_floating_point() and not t.is_complex())
        if a is None:
            return None
        t = self.ns[a]
        views = [a, a, f"{a}.mT" if t.dim() >= 2 else a, f"{a}[1:]" if t.dim() else a,
                 f"{a}[..., ::2]" if t.dim() else a, f"{a}.expand(2, *{a}.shape)"]
        x = r.choice(views)
        b = self.pick(lambda u: u.dtype == t.dtype and u.shape == t.shape) or a
        y = x.replace(a, b, 1)
        ops = [f"{v} = fz.scale_add({x}, {y}, {self.r.choice(['2.0', '-0.5', '0.0'])})",
               f"{v} = fz.twice({x})", f"{v} = fz.pair({x})[{r.randint(0, 1)}]",
               f"fz.addto_({x.replace('.expand(2, *' + a + '.shape)', '')}, {y})",
               f"fz.flip_into_({x.replace('.expand(2, *' + a + '.shape)', '')}, {y})",
               f"{v} = fz.scale_add({x}, {y}, 1.5).sum()"]
        return r.choice(ops)

    # Note [Threads in a program]: the "threads" family runs two statements of the other
    # families at once, each in a thread of its own (`fz.threads`: started together at a
    # barrier, with a short switch interval so their ops interleave, joined; the first's value
    # or the first exception), on CPU and on the device alike. Any interleaving must give
    # CPU's values, so neither writes (in place, out=, set_, requires_grad_) a storage the
    # other reads, at most one draws random numbers (one generator for both threads), and
    # none changes a process-wide setting (the thread count, the matmul precision: CPU's
    # result would depend on when) or runs backward. A sync in one thread may come before the
    # other queues an op: a deferred error of that op may be raised there or at the next sync
    # (as the device's error queue is the process's), which the comparison accepts
    # (`next_sync`, `compare_to_eager`); so is, where both threads raise on CPU, the second's
    # error at the statement while the first's is deferred (`_threads`' fz_others). Flush-to-zero, per thread on CPU
    # (Note [CPU settings]), may be set in one: its ops must compute under that thread's.
    # Sub-statements that are not expressions (`v[0] = x`, `v += x`, `with ...:`) are not
    # used. Policy "threads" adds three other threads issuing their own ops beside it.
    _NOT_IN_THREADS = ("threads", "cores", "autograd", "del")
    _THREAD_UNSAFE = re.compile(r"\.backward\(|autograd\.grad|set_num_threads|"
                                r"matmul_precision|manual_seed|inference_mode")

    def _in_thread(self):
        """A statement of another family as (expression, variable it defines or None, info),
        or None when it cannot run as a lambda (Note [Threads in a program])."""
        fams = [f for f in self.families if f not in self._NOT_IN_THREADS]
        if not fams:
            return None
        fam = self.r.choice(fams)
        code = getattr(self, "f_" + fam)()
        if code is None or self._THREAD_UNSAFE.search(code):
            return None
        d = _DEF.match(code)
        expr = code[d.end() - 1:].strip() if d else code[4:] if code.startswith("_ = ") else code
        try:
            compile(expr, "<thread>", "eval")
        except SyntaxError:
            return None
        info = stmt_info(code)
        muts = set(info["muts"]) | set(re.findall(r"\b(v\d+)\.requires_grad_\(", code))
        if d and d.group(1) in self.ns:  # (a name defined again: the other may read it)
            muts.add(d.group(1))
        return expr, d.group(1) if d else None, {**info, "muts": muts}

    def f_threads(self):
        """Two statements of other families at once, each in a thread of its own (Note
        [Threads in a program]); the first's value is kept, the second's effects are its
        writes."""
        T = self.torch.Tensor
        for _ in range(8):
            a, b = self._in_thread(), self._in_thread()
            if a is None or b is None or a[2]["random"] and b[2]["random"]:
                continue
            vals = [self.ns.get(x) for x in a[2]["reads"] | b[2]["reads"]]
            if not all(isinstance(t, T) for t in vals):  # (what it is cannot be told apart)
                continue
            st = lambda names: {self.ns[x].untyped_storage()._cdata for x in names  # noqa: E731
                                if x in self.ns}
            if st(a[2]["muts"]) & st(b[2]["reads"]) or st(b[2]["muts"]) & st(a[2]["reads"]):
                continue
            call = f"fz.threads(lambda: {a[0]}, lambda: {b[0]})"
            return f"{a[1]} = {call}" if a[1] else call
        return None

    def f_sync(self):
        a = self.pick()
        return self.r.choice(["torch.neuron.synchronize()"] + (
            [f"_ = {a}.cpu()", f"_ = {a}.sum().item()", f"_ = {a}.tolist()"] if a else []))

    def f_del(self):
        a = self.pick()
        return f"del {a}" if a and len(self.vars()) > 2 else None

    # -- driver
    def _sigfpe(self, code: str) -> bool:
        """An integer division reading an int32/int64 tensor that holds its type's minimum:
        INT_MIN // -1 (and % -1) kills CPU's process with SIGFPE (LIMITS), the generator's
        and the reference's (overflow in the "edge" family makes such values)."""
        torch = self.torch
        if not _DIVISION.search(code):
            return False
        for x in stmt_info(code)["reads"]:
            t = self.ns.get(x)
            if isinstance(t, torch.Tensor) and t.dtype in (torch.int32, torch.int64) \
                    and t.numel() and bool((t == torch.iinfo(t.dtype).min).any()):
                return True
        return False

    def step(self, code: str, keep_error: float) -> bool:
        if any(p.search(code) for p in self.exclude) or self._sigfpe(code):
            return False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exec(code, self.ns)
        except Exception:
            if self.r.random() >= keep_error:
                return False
        self.stmts.append(code)
        if self.pending_core is not None:
            self.core[self.pending_core[0]] = self.pending_core[1]
        return True

    def build(self) -> list[str]:
        r = self.r
        self.step(f"torch.manual_seed({r.randint(0, 999)})", 0)
        for _ in range(r.randint(2, 4)):
            self.step(self.create(), 0)
        target = r.randint(*self.length)
        tries = 0
        while len(self.stmts) < target and tries < 200:
            tries += 1
            fam = r.choice(self.families)
            self.pending_core = None
            code = getattr(self, "f_" + fam)() if fam != "create" else self.create()
            if code is None:
                continue
            self.step(code, keep_error=self.keep_error)
        self.stmts.append("torch.neuron.synchronize()")
        return self.stmts


_DIVISION = re.compile(r"//|%|\bdiv\b|div_|fmod|remainder|divide|floor_divide")


def generate(seed: int, families=None, exclude=()) -> list[str]:
    """Program `seed`: statements from `families`, none matching an `exclude` regex."""
    return Gen(seed, families, exclude).build()


# --------------------------------------------------------------------------- custom ops

_FZ = []


def _fz():
    """The "custom" family's ops (torch.library, as adaptive_eager/integration/README.md's
    "Custom kernels" shows users), defined once per process: `fz.scale_add` (a neuron kernel
    and autograd),
    `fz.twice` (no neuron kernel: CPU's, a fallback), `fz.pair` (two results), and
    `fz.addto_` / `fz.flip_into_` (each writes its first argument, whatever its layout);
    and the "threads" family's `fz.threads` (`_threads`)."""
    if _FZ:
        return _FZ[0]
    import types
    import torch
    lib = "fuzz_ops"

    def both(name, fn, fake, schema, mutates=(), device=True):
        # (schemas spelled out: this module's annotations are strings)
        op = torch.library.custom_op(f"{lib}::{name}", mutates_args=mutates, schema=schema)(fn)
        op.register_fake(fake)
        if device:
            op.register_kernel("neuron")(fn)
        return op

    def scale_add(x, y, a):
        return x * a + y

    def twice(x):
        return x * 2

    def pair(x):
        return x.clone(), x.sum(0) if x.dim() else x.clone()

    def addto_(x, y):
        x.add_(y)

    def flip_into_(out, x):
        out.copy_(x.flip(0) if x.dim() else x)

    fz = types.SimpleNamespace(
        scale_add=both("scale_add", scale_add, lambda x, y, a: torch.empty_like(x),
                       "(Tensor x, Tensor y, float a) -> Tensor"),
        twice=both("twice", twice, lambda x: torch.empty_like(x), "(Tensor x) -> Tensor",
                   device=False),
        pair=both("pair", pair, lambda x: (torch.empty_like(x), x.sum(0) if x.dim()
                                           else torch.empty_like(x)),
                  "(Tensor x) -> (Tensor, Tensor)"),
        addto_=both("addto_", addto_, lambda x, y: None, "(Tensor(a!) x, Tensor y) -> ()",
                     mutates=("x",)),
        flip_into_=both("flip_into_", flip_into_, lambda out, x: None,
                         "(Tensor(a!) out, Tensor x) -> ()", mutates=("out",)))

    def setup(ctx, inputs, output):
        ctx.a = inputs[2]

    fz.scale_add.register_autograd(lambda ctx, g: (g * ctx.a, g, None), setup_context=setup)
    fz.threads = _threads
    _FZ.append(fz)
    return fz


def _threads(*fns):
    """Each callable in a thread of its own, started together and joined: the first one's
    value, or the first exception in the callables' order (Note [Threads in a program])."""
    import threading
    out, errs = [None] * len(fns), [None] * len(fns)
    go = threading.Barrier(len(fns))

    def run(k):
        try:
            go.wait()
            out[k] = fns[k]()
        except BaseException as e:  # (raised in the caller's thread, below)
            errs[k] = e
    ts = [threading.Thread(target=run, args=(k,), name=f"fuzz-{k}") for k in range(len(fns))]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # (so the threads' ops interleave, not run one after the other)
    try:
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    raised = [e for e in errs if e is not None]
    if raised:  # (the others' types ride along: a device may defer the first's error)
        raised[0].fz_others = [type(e).__name__ for e in raised[1:]]
        raise raised[0]
    return out[0]


# --------------------------------------------------------------------------- running

_THREADS = []  # the worker's intra-op thread count at start


def _namespace(dev):
    """A program's globals; every run starts from seed 0 (PRELUDE), as the snippet does, and
    from the default CPU settings (the "settings" family changes them)."""
    import torch
    if not _THREADS:
        _THREADS.append(torch.get_num_threads())
    torch.set_flush_denormal(False)
    torch.set_num_threads(_THREADS[0])
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(0)
    import torch.nn.functional as F
    import adaptive_eager as ae
    cores = {f"dev{k}": dev if dev == "cpu" else f"{dev}:{k}" for k in (1, 2, 3)}
    return {"torch": torch, "F": F, "ae": ae, "dev": dev, **cores, "fz": _fz(),
            "__builtins__": __builtins__}


def _err(i, e):
    return {"at": i, "type": type(e).__name__, "msg": str(e).split("\n")[0][:300],
            "deferred": type(e).__name__ == "NeuronRuntimeError",
            "others": getattr(e, "fz_others", [])}  # (`_threads`)


def _read(t):
    """A tensor's metadata and value on the host, or the error reading it raised."""
    import torch
    out = {"dtype": str(t.dtype), "shape": list(t.shape), "stride": list(t.stride()),
           "offset": t.storage_offset()}
    try:  # a view of a multi-output view modified in place raises even here (as on CPU)
        out["requires_grad"] = t.requires_grad
    except Exception as e:
        out["read_error"] = type(e).__name__
        return out
    try:
        out["value"] = t.detach().cpu().clone()
    except Exception as e:
        out["read_error"] = type(e).__name__
    try:  # is_leaf builds the view's grad_fn: it raises like requires_grad above
        leaf = t.requires_grad and t.is_leaf
    except Exception as e:
        out["read_error"] = type(e).__name__
        return out
    if leaf:
        try:
            g = t.grad
            out["grad"] = None if g is None else g.detach().cpu().clone()
        except Exception as e:
            out["read_error"] = type(e).__name__
    return out


def run_program(stmts, dev, mode="eager", policy="default", noise=None):
    """Run statements in order; stop at the first error. Returns (error, {var: reading}).
    Policy "threads": `_Noise` runs beside the program; what it found goes to `noise`."""
    import torch
    import adaptive_eager as ae
    import contextlib
    with contextlib.ExitStack() as st, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dev != "cpu":
            if policy == "lazy":
                st.enter_context(ae.override(queue_low_threshold=0))
            if policy == INDUCTOR:
                st.enter_context(ae.override(executor="inductor"))
            if policy == REPEAT:
                st.enter_context(ae.override(check_replay=True))
            if mode != "eager":
                st.enter_context(ae.adaptive(strategy=mode))
            if policy == THREADS:
                st.enter_context(_Noise(noise))
        for _ in range(3 if policy == REPEAT else 1):
            ns = _namespace(dev)
            err = None
            for i, code in enumerate(stmts):
                try:
                    exec(code, ns)
                except Exception as e:
                    err = _err(i, e)
                    break
            reads = {k: _read(v) for k, v in ns.items()
                     if _VAR.fullmatch(k) and isinstance(v, torch.Tensor)}
            if policy == REPEAT:  # its deferred errors stay with this run (modes untouched)
                try:
                    ae.synchronize()
                except Exception:
                    pass
    _settle()
    return err, reads


def run_compiled(stmts, dev, mode="eager"):
    """Policy compile: the program as one function compiled by torch.compile, its variables
    returned at the end; backend "neuron" on the device (in `mode`), "aot_eager" on CPU, so
    both sides share Dynamo's and AOTAutograd's semantics (graph breaks at syncs, data-
    dependent ops, prints) and only the backend differs. Returns (error, {var: reading})."""
    import torch
    import torch._dynamo
    import adaptive_eager as ae
    import contextlib
    torch._dynamo.reset()
    if dev == "cpu":  # the reference: PyTorch's decompositions, the wrong ones corrected as
        # the device corrects them (Note [Wrong decompositions in graphs])
        from fusion import decomps
        decomps.register(torch._C.DispatchKey.AutogradCPU)
    ns = _namespace(dev)
    exec(_program_source(stmts), ns)
    fn = torch.compile(ns["program"], backend="neuron" if dev != "cpu" else "aot_eager")
    err, reads = None, {}
    with contextlib.ExitStack() as st, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dev != "cpu" and mode != "eager":
            st.enter_context(ae.adaptive(strategy=mode))
        try:
            out = fn()
            reads = {k: _read(v) for k, v in out.items() if isinstance(v, torch.Tensor)}
        except Exception as e:
            err = _err(0, e)
    _settle()
    torch._dynamo.reset()
    # Note [A compile failure can break the process]: AOTAutograd failing inside an
    # inference_mode block ("Cannot set version_counter for inference tensor", CPU's
    # aot_eager too) leaves the PythonDispatcher key set in this thread's dispatch keys
    # (a PyTorch bug): every later compile then fails at once, and the policy skipped every
    # later program (seed 140010: ~100 programs a second, none compiled). The worker asks
    # the Pool to replace it, in its answer.
    if torch._C._dispatch_tls_local_include_set().has(torch._C.DispatchKey.PythonDispatcher):
        BROKEN[0] = True
    return err, reads


# the worker cannot compile any more: Note [A compile failure can break the process]
BROKEN = [False]


def _program_source(stmts) -> str:
    """`def program():` running the statements and returning every variable they define.
    `del` is left out: AOTAutograd drops a random op whose value is dead, which moves every
    later draw (a PyTorch fact of compiled randomness; fuzzer seed 900250)."""
    names = []
    for code in stmts:
        info = stmt_info(code)
        if info["defs"] and info["defs"] not in names:
            names.append(info["defs"])
    body = ["pass" if stmt_info(c)["deletes"] else c for c in stmts]
    return ("def program():\n" + "".join(f"    {c}\n" for c in body)
            + "    return {" + ", ".join(f"{n!r}: {n}" for n in names) + "}\n")


def compare_compiled(ref, cpu, run, evenly=False) -> list[tuple[str, str]]:
    """Policy compile: the device's compiled run against CPU's (values by the rules of
    `compare_reading`, taints from the eager CPU reference `ref`). A value that differs from
    CPU's compiled one but equals CPU's eager one is PyTorch's compile differing from eager
    (seed 313 of the prototype: aot_eager lost a 0-d tensor's later `zero_()`), not ours."""
    (nerr, nreads), (_, creads) = run, cpu
    if nerr is not None:
        return [("raised", f"compiled on neuron raised {nerr['type']} where CPU's "
                           f"aot_eager does not: {nerr['msg']}")]
    fails, taint = [], ref[2]
    for var, n in sorted(nreads.items()):
        c = creads.get(var)
        if c is None or var not in ref[1] or "err" in taint.get(var, []):
            continue  # (a deleted variable is returned only to keep its draw alive)
        if "read_error" in n or "read_error" in c:
            if n.get("read_error") != c.get("read_error"):
                fails.append(("read", f"reading {var} raised {n.get('read_error')}, on CPU "
                                      f"{c.get('read_error')}"))
            continue
        diff = compare_reading(var, n, c, taint.get(var, []), evenly)
        eager = ref[1].get(var)
        if diff and eager is not None and "read_error" not in eager and not compare_reading(
                var, n, eager, taint.get(var, []), evenly):
            continue
        fails += diff
    return fails


class _Noise:
    """Other threads on the same device while a program runs (policy "threads"): each
    records small chains on its own tensors, syncs and reads them back, and checks each value
    bit for bit against the same ops on CPU. The GIL switches every 10 us meanwhile, so their
    ops land between the program's and each other's: in its queue, its fused groups, its
    flushes and syncs. Three of them, and some of their values copied in from the host
    (`torch.tensor(k, device=...)`, a kernel PyTorch reaches below the Python key): with one
    thread and Python scalars only, a copy-in that skipped the engine lock failed about 1
    program in 1000 (seeds 1206, 856). They draw no random numbers and change no global
    state, so the program's own results must not move. What they find (a wrong value, an
    error) is appended to `problems`."""

    THREADS = 3

    def __init__(self, problems: list):
        import threading
        self.problems = problems
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True)
                        for _ in range(self.THREADS)]

    def _run(self):
        import torch
        try:
            cpu = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7
            x = cpu.to("neuron")
            k = 0
            while not self.stop.is_set() or k < 4:  # at least one sync and two reads
                k += 1
                add, add_cpu = ((torch.tensor(float(k), device="neuron"), torch.tensor(float(k)))
                                if k % 3 == 0 else (k, k))
                y, want = (x * 1.5 + add).relu().sum(0), (cpu * 1.5 + add_cpu).relu().sum(0)
                x, cpu = x.mul(0.5).add_(y[:4, None] / 24), cpu.mul(0.5).add_(want[:4, None] / 24)
                if k % 4 == 0:
                    torch.neuron.synchronize()  # a sync from another thread, mid-program
                if k % 2 == 0:
                    got = y.cpu()
                    if not _bits_equal(got, want):
                        self.problems.append(f"its value at step {k}: {got} vs CPU {want}")
                        return
        except Exception as e:  # noqa: BLE001  any error here is the engine's
            self.problems.append(f"it raised {type(e).__name__}: {str(e)[:300]}")

    def __enter__(self):
        self.interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        deadline = time.monotonic() + 120  # (all of them: within the worker's timeout)
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        sys.setswitchinterval(self.interval)
        if any(t.is_alive() for t in self.threads):
            self.problems.append("it did not finish in 120 s")


def _settle():
    import adaptive_eager as ae
    try:
        ae.set_adaptive(False)
        ae.synchronize()
    except Exception:
        pass


def _grad_leaf(t) -> bool:
    """A leaf that requires grad; False for a view whose grad_fn PyTorch refuses to build (a
    multi-output view whose base was modified in place raises on `requires_grad`)."""
    try:
        return t.requires_grad and t.is_leaf
    except RuntimeError:
        return False


def _as_a_copy(code: str) -> str:
    """`.cpu()` of a CPU tensor is the tensor itself; of a device tensor, a copy made through
    autograd (`_to_copy`), which refuses, for one, a multi-output view whose base was modified
    in place (CUDA too; fuzzer seed 8101303). The reference copies as a device does."""
    return code.replace(".cpu()", ".to('cpu', copy=True)")


def run_reference(stmts, upto=None, fail_at=None):
    """CPU, skipping statements that raise; returns (first error, readings, taint flags).

    The first error carries `all`: {statement: exception type} of every statement that
    raised. `upto`: stop after that statement; `fail_at`: treat that statement as failed
    (the neuron run stopped there, so its effects are unknown).

    Taints per variable: 'err' (depends on a skipped statement), 'f64' (computed from
    float64), 'rng64' (depends on a float64 random draw). Note [Comparison rules]."""
    import torch
    ns = _namespace("cpu")
    taint: dict[str, set] = {}
    first = None
    errors: dict[int, str] = {}
    n = len(stmts) if upto is None else upto + 1
    rng_diverged = False  # a float64 draw moved CPU's stream differently from the device's

    def aliases(name):
        t = ns.get(name)
        if not isinstance(t, torch.Tensor):
            return {name}
        p = t.untyped_storage().data_ptr()
        return {k for k, u in ns.items() if _VAR.fullmatch(k) and isinstance(u, torch.Tensor)
                and (u is t or (p and u.untyped_storage().data_ptr() == p))} | {name}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, code in enumerate(stmts[:n]):
            info = stmt_info(code)
            if info["backward"]:  # writes the .grad of every leaf it reaches
                info["muts"] |= {k for k, u in ns.items() if _VAR.fullmatch(k)
                                 and isinstance(u, torch.Tensor) and _grad_leaf(u)}
            inherited = set().union(*(taint.get(x, set()) for x in info["reads"] if x in ns)) \
                if info["reads"] else set()
            missing = any(x not in ns for x in info["reads"])
            f64_in = any(isinstance(ns.get(x), torch.Tensor) and ns[x].dtype == torch.float64
                         for x in info["reads"])
            ok = not missing and "err" not in inherited and i != fail_at
            if ok:
                try:
                    exec(_as_a_copy(code), ns)
                except Exception as e:
                    ok = False
                    errors[i] = type(e).__name__
                    if first is None:
                        first = _err(i, e)
            new = set(inherited)
            if not ok:
                new.add("err")
            d = info["defs"]
            res = ns.get(d) if d else None
            if f64_in or (isinstance(res, torch.Tensor) and res.dtype == torch.float64):
                new.add("f64")
            # a float64 draw: from a float64 input or dtype (`randn(...).double()` draws float32)
            if f64_in and _F64_CUT.search(code):
                new.add("f64cut")  # float32 rounding may flip a discrete outcome
            elif f64_in and isinstance(res, torch.Tensor) and not res.is_floating_point():
                new.add("f64disc")  # so may a comparison (`v1 == v2`): and all made from it
            if info["random"] and ok and (f64_in or "dtype=torch.float64" in code):
                new.add("rng64")
                rng_diverged = True
            if info["random"] and rng_diverged:
                new.add("rng64")
            if "manual_seed(" in code:
                rng_diverged = False
            if info["deletes"]:
                continue  # its taints stay: an earlier statement read it (seed 20004439)
            targets = set(info["muts"]) | ({d} if d else set())
            for x in list(targets):
                targets |= aliases(x)
            for x in targets:
                if ok and x == d and x not in info["muts"] and not (aliases(x) - {x}):
                    taint[x] = set(new)  # a fresh value: only what it was computed from
                else:
                    taint[x] = taint.get(x, set()) | new
            if not ok and d:
                ns.pop(d, None)
        reads = {k: _read(v) for k, v in ns.items()
                 if _VAR.fullmatch(k) and isinstance(v, torch.Tensor)}
    if first is not None:
        first["all"] = errors
    return first, reads, {k: sorted(v) for k, v in taint.items()}


# --------------------------------------------------------------------------- comparison

def _floaty(dtype: str) -> bool:
    return dtype in ("torch.float32", "torch.float64", "torch.float16", "torch.bfloat16")


def _significant(shape, stride):
    return [s for n, s in zip(shape, stride) if n > 1]


def _bits_equal(a, b) -> bool:
    import torch
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_complex():  # as two floats each (nan != nan in torch.equal)
        return _bits_equal(torch.view_as_real(a.resolve_conj()),
                           torch.view_as_real(b.resolve_conj()))
    if a.is_floating_point():
        na, nb = a.isnan(), b.isnan()
        if not torch.equal(na, nb):
            return False
        ib = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.masked_fill(na, 0).contiguous().view(ib),
                           b.masked_fill(nb, 0).contiguous().view(ib))
    return torch.equal(a, b)


_F32_EDGE = 1e18  # float64 values this large may saturate float32 inside an op (a norm or
# a variance squares them: past sqrt(float32 max) = 1.8e19 the square is inf)


def _close(n, c, f64: bool) -> str | None:
    import torch
    try:
        if f64:
            n, c = n.to(torch.float32), c.to(torch.float32)
            if n.is_floating_point():  # near float32's limit, float32 saturates inside the op
                # (a mean of four 8.5e37s is inf) and inf arithmetic gives NaN (gelu(inf))
                n = torch.where(~n.isfinite() & (c.abs() >= _F32_EDGE), c, n)
            torch.testing.assert_close(n, c, rtol=1e-3, atol=1e-3, equal_nan=True)
        elif n.is_floating_point() or n.is_complex():
            torch.testing.assert_close(n, c, equal_nan=True)
        elif not torch.equal(n, c):
            return "values differ"
    except AssertionError as e:
        return str(e).strip().split("\n")[0][:200] + " " + " ".join(
            str(e).strip().split("\n")[1:4])[:300]
    return None


# Ops whose result can jump when float64 is computed as float32 (Note [Comparison rules]):
# data-dependent shapes (what a mask selects) and discontinuous functions of the values.
_F64_CUT = re.compile(r"nonzero|argwhere|masked_select|\[[^\]]*[<>]|\[[^\]]*[!=]=|%|fmod|"
                      # one-argument where is nonzero (seed 31003668: float64 sigmoid(-100)
                      # is 3.7e-44 > 0, computed as float32 it is 0)
                      r"where\((?:[^,()]|\([^()]*\))*\)|"
                      r"remainder|floor|ceil|round|trunc|frac|sign|unique|//|"
                      # adaptive optimizers step by g / (|g| + eps): near a zero gradient
                      # (rounding noise, 1e-17 in float64, 1e-8 in float32) a jump of lr
                      r"optim\.(Adam|AdamW|RMSprop|Adagrad)\(|"
                      # the gradient of an elementwise max/min splits at a tie: x.float() and
                      # its float64 source tie once float64 is float32 (seed 34006051)
                      r"maximum|minimum|fmax|fmin|"
                      # a foreach op on float32 twins takes the fused kernel where CPU's mixed
                      # dtypes take the per-tensor path, which order writes to an internally
                      # overlapping view (unfold) differently (seed 34012598)
                      r"_foreach_\w+_\(")


def compare_reading(var, n, c, taint, evenly=False) -> list[tuple[str, str]]:
    """(kind, detail) for each way a neuron reading differs from CPU's. `evenly`: the
    program has a full min/max/median reduction (_EVENLY)."""
    import torch
    out = []
    if "f64cut" in taint:  # as a float64 random draw: the dtype must match, nothing else
        taint = list(taint) + ["rng64"]
    # a value drawn from the float32 stream for float64 (rng64) may differ, and so may the
    # shape of what a data-dependent op (nonzero, where) makes of it: its dtype must match
    for key in ("dtype",) if "rng64" in taint else ("dtype", "shape"):
        if n[key] != c[key]:
            return [(key, f"{var}: neuron {n[key]} vs cpu {c[key]}")]
    if "rng64" in taint:
        return out
    # requires_grad of an integer or bool tensor is compared only for floats: `t[...] = v` with
    # a 0-d v is fill_ on CPU but copy_ on any device (PyTorch's indexing, CUDA alike), and
    # only CPU's fill_ marks an integer tensor as requiring grad.
    if n.get("requires_grad") != c.get("requires_grad") and _floaty(c["dtype"]):
        out.append(("requires_grad", f"{var}: neuron {n['requires_grad']} vs cpu {c['requires_grad']}"))
    if "value" in c and "value" in n and c["value"].numel() > 0:
        if (_significant(n["shape"], n["stride"]) != _significant(c["shape"], c["stride"])
                or (n["offset"] != c["offset"])):
            out.append(("stride", f"{var}: neuron stride {n['stride']} offset {n['offset']} "
                                  f"vs cpu {c['stride']} offset {c['offset']}"))
    if "rng64" in taint:
        return out
    f64 = "f64" in taint
    if (f64 and not _floaty(c["dtype"])) or "f64disc" in taint:
        return out
    if "value" in n and "value" in c:
        d = _close(n["value"], c["value"], f64)
        if d:
            out.append(("value", f"{var}: {d}"))
    if ("grad" in n) != ("grad" in c) or ((n.get("grad") is None) != (c.get("grad") is None)):
        out.append(("grad", f"{var}: neuron grad {n.get('grad') is not None} vs cpu "
                            f"{c.get('grad') is not None}"))
    elif n.get("grad") is not None:
        ng, cg = n["grad"], c["grad"]
        if ng.dtype != cg.dtype or ng.shape != cg.shape:
            out.append(("grad", f"{var}.grad: neuron {ng.dtype}{list(ng.shape)} vs cpu "
                                f"{cg.dtype}{list(cg.shape)}"))
        else:
            if evenly and ng.is_floating_point():  # 0 * inf (or NaN) on a device: _EVENLY
                ng = torch.where(ng.isnan(), cg, ng)  # (and added to what was there before)
            d = _close(ng, cg, f64)
            if d:
                out.append(("grad", f"{var}.grad: {d}"))
    return out


# Full min/max/median reductions: PyTorch's backward (evenly_distribute_backward) takes
# `mask * (grad / count)` for CUDA and tensor subclasses but `masked_fill_` on CPU, so an
# infinite or NaN gradient gives NaN beside the selected elements on any device, 0 on CPU
# only (checked with PyTorch's own TwoTensor subclass on CPU), also once accumulated into a
# .grad that held something (final-bar seed 10175339).
_EVENLY = re.compile(r"\.(min|max|median|nanmedian)\(\)|torch\.(min|max|median|nanmedian)\(v\d+\)")


def next_sync(stmts, i):
    """The first sync statement from i on that surely follows i's ops: not i itself when it
    runs threads, whose one thread may sync before the other queues its op (Note [Threads in
    a program])."""
    for j in range(i, len(stmts)):
        if stmt_info(stmts[j])["sync"] and not (j == i and "fz.threads" in stmts[j]):
            return j
    return len(stmts) - 1


def _reads_failed(code, ref) -> bool:
    """Statement `code` reads a variable the reference marks as depending on a failure."""
    taint = ref[2]
    return any("err" in taint.get(x, ()) for x in stmt_info(code)["reads"])


def _reads_shapeless(code, ref) -> bool:
    """Statement `code` reads a value whose shape the float64 policy leaves free (a float64
    random draw, or what a discrete op made of a float64 value): whether it raises (an index
    past the end of `where(mask)[0]`) is as free as that shape."""
    taint = ref[2]
    return any({"rng64", "f64cut"} & set(taint.get(x, ())) for x in stmt_info(code)["reads"])


_CONTRACTION = re.compile(r"@|matmul|bmm|einsum|\bmm\(|linear|\bmv\(|\bdot\(|"
                          r"scaled_dot_product_attention")  # (its math path: final-bar 10254122)


def _empty_mixed_contraction(stmts, nerr, ref) -> bool:
    """Neuron raised CPU's own dtype error on an empty contraction of two dtypes: plain CPU's
    matmul reaches bmm, which returns an empty result before checking dtypes; under Python
    dispatch (our tensors; any TorchDispatchMode on CPU too) PyTorch's decomposition reaches mm,
    which checks first. The statement it stopped at is not compared past that."""
    code, readings = stmts[nerr["at"]], ref[1]
    return (nerr["type"] == "RuntimeError" and "same dtype" in nerr["msg"]
            and bool(_CONTRACTION.search(code))
            and any(0 in readings[x]["shape"] for x in stmt_info(code)["reads"]
                    if x in readings))


def _mixed_contraction_refused(stmts, nerr, cerr) -> bool:
    """Both refuse a contraction of two dtypes at one statement, in different words: plain
    CPU's matmul reaches bmm, whose kernel refuses the dtype (NotImplementedError); under
    Python dispatch (any TorchDispatchMode on CPU too) the decomposition reaches mm, whose
    check refuses the mix first (RuntimeError, "same dtype"). Fuzzer seed 714619."""
    return (nerr["at"] == cerr["at"] and nerr["type"] == "RuntimeError"
            and "same dtype" in nerr["msg"] and cerr["type"] == "NotImplementedError"
            and bool(_CONTRACTION.search(stmts[nerr["at"]])))


def _aliased_0d_setitem(stmts, nerr, ref) -> bool:
    """`t[...] = s` with a 0-d `s` over `t`'s memory: PyTorch fills from a CPU value (fill_)
    but copies on any device (copy_, CUDA alike), whose overlap check refuses it."""
    code = stmts[nerr["at"]]
    m = _SETITEM.match(code)
    rhs = code.split("=", 1)[1].strip() if m and not m.group(2) else ""
    return ("refer to a single memory location" in nerr["msg"] and _VAR.fullmatch(rhs)
            is not None and ref[1].get(rhs, {}).get("shape") == [])


_INPLACE_VIEW = re.compile(r"^(v\d+)\.(unsqueeze_|squeeze_|t_|transpose_|swapdims_|"
                           r"swapaxes_|as_strided_)\(")


def _replayed_views(stmts) -> set:
    """Autograd rebuilds a view of a base changed by an in-place view op (`b.unsqueeze_(0)`)
    by replaying the view op for `__torch_dispatch__` tensors (CPU and CUDA use as_strided),
    and the replayed op may refuse the new rank (PyTorch's, not fixable from outside). The
    views taken of such a base before its in-place view op (or out= resize): using or
    reading one may raise (RuntimeError, IndexError: the replayed op's) on neuron only."""
    out = set()
    for i, code in enumerate(stmts):
        m = _INPLACE_VIEW.match(code)
        bases = {m.group(1)} if m else set()
        bases |= set(_OUT.findall(code))  # an out= resize restrides its tensor in place too
        for b in bases:
            out |= {stmt_info(stmts[k])["defs"] for k in range(i)
                    if b in stmt_info(stmts[k])["reads"]} - {None, b}
    return out


def _view_replay(stmts, nerr) -> bool:
    return bool(_replayed_views(stmts[:nerr["at"]]) & stmt_info(stmts[nerr["at"]])["reads"])


def compare(stmts, ref, run) -> list[tuple[str, str]]:
    """Failures of one neuron run against the CPU reference (Note [Comparison rules])."""
    cerr, _, _ = ref
    nerr, nreads = run
    fails = []
    deferred = False
    same = cerr and nerr and (cerr["at"], cerr["type"]) == (nerr["at"], nerr["type"])
    first = min(e["at"] for e in (cerr, nerr) if e) if cerr or nerr else None
    if first is not None and not same and _reads_shapeless(stmts[first], ref) and not (
            cerr and nerr and nerr["at"] > cerr["at"]):
        deferred = True  # the runs part where the policy leaves a shape free: compare before
    elif nerr is not None and not same and (cerr is None or cerr["at"] >= nerr["at"]) \
            and _view_replay(stmts, nerr):
        deferred = True  # PyTorch's view replay refused first (_replayed_views)
    elif cerr is None and nerr is not None and (_empty_mixed_contraction(stmts, nerr, ref)
                                                or _aliased_0d_setitem(stmts, nerr, ref)):
        pass  # PyTorch's own behaviour on devices (each function's docstring)
    elif cerr is None and nerr is not None:
        return [("raised", f"neuron raised {nerr['type']} at statement {nerr['at']} where "
                           f"CPU does not: {nerr['msg']}")]
    elif cerr is not None:
        if nerr is None:
            return [("raised", f"CPU raised {cerr['type']} at statement {cerr['at']} "
                               f"({cerr['msg']}); neuron raised nothing")]
        i, j = cerr["at"], nerr["at"]
        if j == i and (nerr["type"] == cerr["type"]
                       or nerr["type"] in cerr.get("others", ())
                       or _mixed_contraction_refused(stmts, nerr, cerr)):
            # in other words: a check above the device (autograd's) refused after the op was
            # queued, where CPU's kernel refused first: its deferred error may follow; or
            # CPU's other thread raised it too, the first thread's error deferred on the
            # device (Note [Threads in a program])
            deferred = nerr["msg"] != cerr["msg"] or bool(cerr.get("others"))  # (the other
            # thread's error may be pending on the device)
        elif i <= j <= next_sync(stmts, i) and (
                nerr["deferred"] or cerr["all"].get(j) == nerr["type"]
                or (j > i and _reads_failed(stmts[j], ref))):
            # i's error is pending (or j raised on CPU too, i deferred; or j reads what i
            # left undefined and raises its own error at the call, as CUDA would)
            deferred = True
        else:
            return [("raised", f"CPU raised {cerr['type']} at statement {i} ({cerr['msg']}); "
                               f"neuron raised {nerr['type']} at statement {j} ({nerr['msg']})")]
    # the reference as far as the neuron run went; the statement it stopped at counts as failed
    upto = nerr["at"] if nerr else None
    _, creads, taint = run_reference(stmts, upto, upto) if upto is not None else ref
    replayed = _replayed_views(stmts if upto is None else stmts[:upto + 1])
    for var, n in sorted(nreads.items()):
        t = taint.get(var, [])
        if "err" in t:
            continue
        c = creads.get(var)
        if c is None:
            fails.append(("missing", f"{var} exists on neuron only"))
            continue
        if "read_error" in n:
            same = n["read_error"] == c.get("read_error")  # CPU refuses to read it too
            if var in replayed and n["read_error"] in ("RuntimeError", "IndexError"):
                continue  # PyTorch's view replay refuses (_replayed_views)
            if not same and not (deferred and n["read_error"] == "NeuronRuntimeError"):
                fails.append(("read", f"reading {var} raised {n['read_error']}"))
            continue
        fails += compare_reading(var, n, c, t, any(_EVENLY.search(x) for x in stmts))
    return fails


# Note [Warnings compared]: CPU and the device must warn at the same statements, as often
# and in the same words (issue 23). The device's own warnings (fell back, float64 policy) are
# not CPU's; a warning CPU gives only once per process (TypedStorage's deprecation, a
# TORCH_WARN_ONCE) is left out: it is seen on CPU's first run and not on its second.
_OWN_WARNINGS = re.compile(r"fell back to CPU|float64 is not supported|TypedStorage is "
                           r"deprecated|not supported on Neuron")


def run_warnings(stmts, dev, mode="eager") -> list | None:
    """(statement, category, text) of every warning, or None if a statement raised."""
    import contextlib
    import adaptive_eager as ae
    out = []
    with contextlib.ExitStack() as st:
        if dev != "cpu" and mode != "eager":
            st.enter_context(ae.adaptive(strategy=mode))
        ns = _namespace(dev)
        for i, code in enumerate(stmts):
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                try:
                    exec(code, ns)
                except Exception:
                    return None
            out += [(i, x.category.__name__, str(x.message)) for x in w
                    if not _OWN_WARNINGS.search(str(x.message))]
    _settle()
    return out


def compare_warnings(stmts, mode) -> list[tuple[str, str]]:
    """Note [Warnings compared]: the device's warnings against CPU's, by statement."""
    cpu = run_warnings(stmts, "cpu")
    again = run_warnings(stmts, "cpu")
    if cpu is None or again is None:
        return []
    once = {t for _, _, t in cpu} - {t for _, _, t in again}
    dev = run_warnings(stmts, "neuron", mode)
    if dev is None:
        return []
    # (a statement's threads warn in the order they run: Note [Threads in a program])
    order = lambda x: x if "fz.threads" in stmts[x[0]] else x[:1]  # noqa: E731
    cpu = sorted((x for x in again if x[2] not in once), key=order)
    dev = sorted((x for x in dev if x[2] not in once), key=order)
    if dev == cpu:
        return []
    for c, d in zip(cpu + [None] * len(dev), dev + [None] * len(cpu)):
        if c != d:
            fmt = lambda x: "nothing" if x is None else f"{x[1]} at statement {x[0]}: " \
                f"{x[2][:120]}"  # noqa: E731
            return [("warning", f"CPU warned {fmt(c)}; neuron warned {fmt(d)}")]
    return []


def compare_to_eager(eager, run, taint, stmts=()) -> list[tuple[str, str]]:
    """Adaptive must equal eager bit for bit (NaN equal to NaN); values poisoned by a failed
    statement (CPU taint 'err') are undefined in both and not compared."""
    (ee, er), (ae_, ar) = eager, run
    if ee and ae_ and ee["deferred"] and ae_["deferred"] and ee["at"] != ae_["at"]:
        k, j = sorted((ee["at"], ae_["at"]))
        if "fz.threads" in stmts[k] and j <= next_sync(stmts, k):
            # a deferred error of the threads statement k's own ops: its other thread synced
            # (`.tolist()`, or unseen: a CPU fallback, a data-dependent shape; seed 23303296)
            # before or after they were queued (Note [Threads in a program]); each run is
            # compared with CPU up to where it stopped
            return []
    if (ee and (ee["at"], ee["type"])) != (ae_ and (ae_["at"], ae_["type"])):
        fmt = lambda e: "nothing" if e is None else f"{e['type']} at statement {e['at']}"
        return [("vs-eager-raised", f"eager raised {fmt(ee)}, adaptive {fmt(ae_)}")]
    fails = []
    for var, a in sorted(ar.items()):
        e = er.get(var)
        if e is None or "err" in taint.get(var, ()):
            continue
        for key in ("dtype", "shape", "stride", "offset"):
            if a[key] != e[key]:
                fails.append(("vs-eager-" + key, f"{var}: adaptive {a[key]} vs eager {e[key]}"))
        if "value" in a and "value" in e and not _bits_equal(a["value"], e["value"]):
            fails.append(("vs-eager-value", f"{var}: not bit-equal to eager"))
        if "read_error" in a or "read_error" in e:
            if a.get("read_error") != e.get("read_error"):
                fails.append(("vs-eager-read", f"{var}: eager read raised "
                              f"{e.get('read_error')}, adaptive {a.get('read_error')}"))
            continue
        if "value" in a and "read_error" in e:
            fails.append(("vs-eager-read", f"{var}: eager read raised {e['read_error']}"))
        ga, ge = a.get("grad"), e.get("grad")
        if (ga is None) != (ge is None) or (ga is not None and not _bits_equal(ga, ge)):
            fails.append(("vs-eager-grad", f"{var}.grad differs from eager"))
    return fails


def compare_close(stmts, eager, run, taint) -> list[tuple[str, str]]:
    """Policy inductor: the same errors and layouts as neuron eager, values within float
    tolerance (Inductor reassociates and uses other exp/log kernels). A program with an op
    whose result can jump on a rounding difference (`_F64_CUT`: masks, floor, %) has only
    its layouts compared."""
    import torch
    (ee, er), (ie, ir) = eager, run
    if (ee is not None and ee.get("deferred")) or any(
            v.get("read_error") == "NeuronRuntimeError" for v in er.values()):
        # A device-side value error (an index out of range, found at the sync): Inductor's
        # code wraps negative indices that eager refuses, and fails a group as a whole
        # where the interpreter poisons only what depends on the failed op (seed 19000329;
        # fusion/README.md, "Executors"). Not compared.
        return []
    if (ee and (ee["at"], ee["type"])) != (ie and (ie["at"], ie["type"])):
        fmt = lambda e: "nothing" if e is None else f"{e['type']} at statement {e['at']}"  # noqa: E731
        return [("inductor-raised", f"eager raised {fmt(ee)}, inductor {fmt(ie)}")]
    jumps = any(_F64_CUT.search(x) for x in stmts)
    # half precision anywhere: its rounding reaches float32 values made from it (seed 21001181)
    low = any("float16" in x for x in stmts)  # (bfloat16 too)
    fails = []
    for var, a in sorted(ir.items()):
        e = er.get(var)
        if e is None or "err" in taint.get(var, ()):
            continue
        for key in ("dtype", "shape", "stride", "offset", "read_error"):
            if a.get(key) != e.get(key):
                fails.append(("inductor-" + key, f"{var}: inductor {a.get(key)} vs eager "
                                                  f"{e.get(key)}"))
        for key in ("value", "grad"):
            x, y = a.get(key), e.get(key)
            if (x is None) != (y is None):
                fails.append(("inductor-" + key, f"{var}: {key} on one side only"))
            elif x is not None and not jumps:
                # half precision: one rounding apart (Inductor computes in float32)
                tol = 2e-2 if low else 1e-4
                try:
                    torch.testing.assert_close(x, y, rtol=tol, atol=tol, equal_nan=True)
                except AssertionError as err:
                    fails.append(("inductor-" + key, f"{var}: " + " ".join(
                        str(err).strip().split("\n")[:4])[:300]))
    return fails


def configs(modes, policies):
    out = []
    for m in modes:
        for p in policies:
            if p == INDUCTOR and m == "eager":
                continue  # every op would be a compiled group of one
            if m != "eager" or p in ("default", THREADS, COMPILE, REPEAT):  # eager: lazy is default
                out.append((m, p))
    return out


# Programs whose warnings are compared (the families that warn, and CPU's resize warning)
_WARNY = re.compile(r"out=|random_\(|randint\(|torch\.range\(|storage\(\)|uint8")


def check(stmts, cfgs) -> list[dict]:
    """Run one program on CPU and each (mode, policy); every failure as a dict."""
    ref = run_reference(stmts)
    fails = []
    eager = None
    need_eager = any(m == "eager" for m, _ in cfgs) or any(m != "eager" for m, _ in cfgs)
    if need_eager:
        eager = run_program(stmts, "neuron")
        if ("eager", "default") in cfgs:
            fails += [{"config": "eager", "kind": k, "detail": d} for k, d in compare(stmts, ref, eager)]
    if ref[0] is None and _WARNY.search("\n".join(stmts)):  # Note [Warnings compared]
        for m in sorted({m for m, _ in cfgs}):
            fails += [{"config": m, "kind": k, "detail": d}
                      for k, d in compare_warnings(stmts, m)]
    for m, p in cfgs:
        if m == "eager" and p == "default":
            continue
        name = _config_name((m, p))
        if p == COMPILE:
            if ref[0] is not None:  # errors: Dynamo reports them its own way (not compared)
                continue
            cpu = run_compiled(stmts, "cpu")
            if cpu[0] is not None:  # Dynamo cannot run it on CPU either
                continue
            fails += [{"config": name, "kind": k, "detail": d} for k, d in compare_compiled(
                ref, cpu, run_compiled(stmts, "neuron", m), any(_EVENLY.search(x) for x in stmts))]
            continue
        if p == THREADS and ref[0] is not None:
            # A deferred error goes to whichever thread syncs first (the device's error queue
            # is the process's, as a CUDA context's is): the other threads may take it. Only
            # programs CPU runs without an error are run beside the noise thread.
            continue
        if p == INDUCTOR:
            run = run_program(stmts, "neuron", m, p)
            fails += [{"config": name, "kind": k, "detail": d}
                      for k, d in compare_close(stmts, eager, run, ref[2])]
            continue
        noise = []
        run = run_program(stmts, "neuron", m, p, noise)
        if noise:  # (its threads run one chain: one failure, what each found)
            fails.append({"config": name, "kind": "thread",
                          "detail": "the other threads: " + " | ".join(dict.fromkeys(noise))})
        fails += [{"config": name, "kind": k, "detail": d} for k, d in compare(stmts, ref, run)]
        fails += [{"config": name, "kind": k, "detail": d} for k, d in compare_to_eager(eager, run, ref[2], stmts)]
    return fails


# --------------------------------------------------------------------------- worker / pool

def worker_main():
    """Child process: one JSON request per line on stdin, one JSON answer per line on stdout."""
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's "where are you?"
    os.environ.pop("NEURON_LAUNCH_BLOCKING", None)
    import torch  # noqa: F401  (loads adaptive_eager through the entry point)
    out = sys.stdout
    sys.stdout = sys.stderr  # programs may print; keep the protocol channel clean
    for line in sys.stdin:
        req = json.loads(line)
        try:
            fails = check(req["stmts"], [tuple(c) for c in req["configs"]])
        except Exception:
            fails = [{"config": "harness", "kind": "internal", "detail": traceback.format_exc()[-800:]}]
        out.write(json.dumps({"fails": fails, "restart": BROKEN[0]}) + "\n")
        out.flush()


class Pool:
    """One persistent worker child; a crash or hang becomes a failure and a fresh worker."""

    def __init__(self, timeout=300.0):
        self.timeout = timeout
        self.proc = None

    def _start(self):
        env = dict(os.environ)
        env.setdefault("TORCH_NEURONX_NEFF_DISABLE_CACHE", "1")
        env.pop("NEURON_LAUNCH_BLOCKING", None)
        # stderr to a file, not a pipe: a pipe nobody reads fills up (warnings) and blocks
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, env=env)

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
            self.err.close()

    def _kill(self, dump=True):
        if dump and self.proc.poll() is None:  # a hang: have the worker print every thread's stack
            import signal
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
        self.proc.kill()
        self.proc.wait()
        self.proc = None
        self.err.seek(0, os.SEEK_END)
        self.err.seek(max(0, self.err.tell() - 4000))
        err = self.err.read().decode(errors="replace")
        self.err.close()
        return err

    def check(self, stmts, cfgs) -> list[dict]:
        if self.proc is None:
            self._start()
        self.proc.stdin.write(json.dumps({"stmts": stmts, "configs": cfgs}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        if not ready:
            return [{"config": "all", "kind": "hang", "detail": f"no answer in {self.timeout}s",
                     "stderr": self._kill()}]
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            rc = self.proc.returncode
            return [{"config": "all", "kind": "crash", "detail": f"worker exit {rc}",
                     "stderr": self._kill()}]
        answer = json.loads(line)
        if answer.get("restart"):  # Note [A compile failure can break the process]
            self._kill(dump=False)
        return answer["fails"]


# --------------------------------------------------------------------------- shrinking

def signature(f: dict):
    """What makes two failures the same bug: kind and detail, names and numbers blanked."""
    detail = re.sub(r"\bv\d+\b", "v", f["detail"])
    detail = re.sub(r"\[[^\]]*\]", "[]", detail)
    detail = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", detail)
    return (f["kind"], detail[:60])


def _without(stmts, drop):
    """Drop statements, then those reading a variable no remaining statement defines."""
    keep = [s for k, s in enumerate(stmts) if k not in drop]
    while True:
        defined, out = set(), []
        for s in keep:
            info = stmt_info(s)
            if info["reads"] - defined:
                continue
            out.append(s)
            if info["defs"]:
                defined.add(info["defs"])
        if len(out) == len(keep):
            return out
        keep = out


def shrink(stmts, still_fails, budget=300) -> list[str]:
    """Greedy: delete statements (with their dependents), then shrink literal shapes."""
    best = list(stmts)
    calls = 0
    changed = True
    while changed and calls < budget:
        changed = False
        for k in range(len(best) - 1, -1, -1):
            if k >= len(best) or best[k] == "torch.neuron.synchronize()" and k == len(best) - 1:
                continue
            cand = _without(best, {k})
            calls += 1
            if cand != best and still_fails(cand):
                best, changed = cand, True
            if calls >= budget:
                break
    for k, s in enumerate(best):  # shapes (a, b, c) -> smaller
        for m in list(re.finditer(r"\((\d+(?:, \d+)*),?\)", s))[::-1]:
            nums = [int(x) for x in m.group(1).split(", ")]
            start, end = m.start(), m.end()
            for pos in range(len(nums)):
                for smaller in (1, 2):
                    if nums[pos] <= smaller or calls >= budget:
                        continue
                    new = list(nums)
                    new[pos] = smaller
                    txt = "(" + ", ".join(map(str, new)) + ("," if len(new) == 1 else "") + ")"
                    cand = list(best)
                    cand[k] = s[:start] + txt + s[end:]
                    calls += 1
                    if still_fails(cand):
                        best, s, nums, end = cand, cand[k], new, start + len(txt)
                        break
    return best


def snippet(stmts, config: str) -> str:
    mode, _, policy = config.partition("-")
    head = PRELUDE
    body = list(stmts)
    ctxs = ["ae.override(queue_low_threshold=0)"] if policy == "lazy" else []
    if mode in ("graph", "matmul", "none"):
        ctxs.append(f"ae.adaptive(strategy={mode!r})")
    if any("fz." in s for s in body):  # the "custom" family's ops, "threads"' fz.threads
        head += "import sys; sys.path.insert(0, 'tests'); from fuzzer import _fz; fz = _fz()\n"
    if policy == COMPILE:
        run = "print(torch.compile(program, backend='neuron')())"
        if mode != "eager":
            run = f"with ae.adaptive(strategy={mode!r}):\n    {run}"
        return head + _program_source(body) + run + "\n"
    if policy == THREADS:
        head = "import sys; sys.path.insert(0, 'tests'); from fuzzer import _Noise\n" + head
        ctxs.append("_Noise(problems := [])")
        body.append("print('the other threads:', problems)")
    if ctxs:
        head += f"with {', '.join(ctxs)}:\n"
        body = ["    " + s for s in body]
    return head + "\n".join(body)


# --------------------------------------------------------------------------- driver

def _config_name(c) -> str:
    return c[0] + ("" if c[1] == "default" else "-" + c[1])


def _triage(pool, stmts, f, cfgs, do_shrink):
    """(failure, shrunk program). A crash or hang is first re-run alone in a fresh worker:
    earlier programs in the same worker may have set it up."""
    if f["kind"] in ("crash", "hang"):
        pool.close()
        if not any(g["kind"] == f["kind"] for g in pool.check(stmts, cfgs)):
            return {**f, "detail": f["detail"] + " (not reproduced alone in a fresh worker)"}, stmts
    if not do_shrink:
        return f, stmts
    sig, cfg = signature(f), f["config"]
    one = [c for c in cfgs if _config_name(c) == cfg] or cfgs
    if f["kind"] not in ("crash", "hang"):
        one = sorted(set(one) | {("eager", "default")})  # adaptive is compared with eager

    def matching(prog):
        return [g for g in pool.check(prog, one) if signature(g) == sig and g["config"] == cfg]
    small = shrink(stmts, lambda cand: bool(matching(cand)))
    return (matching(small) or [f])[0], small


def fuzz(seeds, modes=MODES, policies=POLICIES, families=None, minutes=None, do_shrink=True,
         log=print, pool=None, exclude=(), make=None):
    """Generate and check programs; returns (programs run, [distinct failures, shrunk])."""
    cfgs = configs(modes, policies)
    own = pool is None
    pool = pool or Pool()
    found: dict = {}
    count = 0
    t_end = None if minutes is None else time.time() + 60 * minutes
    try:
        for seed in seeds:
            if t_end is not None and time.time() > t_end:
                break
            stmts = (make or generate)(seed, families, exclude)
            fails = pool.check(stmts, cfgs)
            count += 1
            for f in fails:
                sig = signature(f)
                if sig in found:
                    found[sig]["count"] += 1
                    found[sig]["configs"] = sorted(set(found[sig]["configs"]) | {f["config"]})
                    continue
                f, small = _triage(pool, stmts, f, cfgs, do_shrink)
                sig = signature(f)
                if sig in found:  # an unreproduced crash seen before
                    found[sig]["count"] += 1
                    continue
                found[sig] = {**f, "seed": seed, "count": 1, "configs": [f["config"]],
                              "snippet": snippet(small, f["config"])}
                log(f"\n=== seed {seed}: {f['config']} {f['kind']}: {f['detail'][:400]}\n"
                    + (f"stderr: ...{f['stderr'][-(4000 if f['kind'] == 'hang' else 400):]}\n"
                       if f.get("stderr") else "")  # (a hang: every thread's stack)
                    + f"{found[sig]['snippet']}\n")
    finally:
        if own:
            pool.close()
    return count, list(found.values())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--programs", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0, help="first program seed")
    ap.add_argument("--mode", action="append", choices=MODES + ["all"])
    ap.add_argument("--policy", choices=POLICIES + [THREADS, COMPILE, INDUCTOR, REPEAT, "both",
                                                    "all"],
                    default="both", help="both: default and lazy; all: also threads")
    ap.add_argument("--families", default=None, help="comma-separated subset of " + ",".join(FAMILIES))
    ap.add_argument("--ci", action="store_true",
                    help="leave out CI_EXCLUDED_FAMILIES and CI_EXCLUDED_PATTERNS (known bugs)")
    ap.add_argument("--exclude", action="append", default=[], help="regex: skip such statements")
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--json", default=None, help="write the failures here")
    a = ap.parse_args(argv)
    if a.worker:
        return worker_main()
    modes = MODES if not a.mode or "all" in a.mode else a.mode
    policies = {"both": POLICIES, "all": POLICIES + [THREADS, REPEAT]}.get(a.policy, [a.policy])
    fams = a.families.split(",") if a.families else list(FAMILIES)
    exclude = list(a.exclude)
    if a.ci:
        fams = [f for f in fams if f not in CI_EXCLUDED_FAMILIES]
        exclude += list(CI_EXCLUDED_PATTERNS)
    if a.programs is None and a.minutes is None:
        a.programs = 100
    seeds = range(a.seed, a.seed + a.programs) if a.programs else itertools.count(a.seed)
    t0 = time.time()
    n, fails = fuzz(seeds, modes, policies, fams, a.minutes, not a.no_shrink, exclude=exclude)
    dt = time.time() - t0
    print(f"\n{n} programs, modes {modes}, policies {policies}, {dt:.0f} s: "
          f"{len(fails)} distinct failure(s)")
    for f in fails:
        print(f"- {f['kind']} in {','.join(f['configs'])} (x{f['count']}, first seed "
              f"{f['seed']}): {f['detail'][:150]}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"programs": n, "seconds": dt, "failures": fails}, fh, indent=1)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
