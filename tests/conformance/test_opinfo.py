"""OpInfo differential test: CPU vs neuron eager vs neuron adaptive (graph strategy).

For every OpInfo of PyTorch's `op_db` (float32, forward; the function variant, the in-place
one, the `out=` one into a strided view of a larger buffer and into an empty tensor; the
function and in-place ones again on the first 3 samples spread out, every tensor every
other element of a larger buffer) we take the first `SAMPLES_PER_OP` sample inputs, run the
op on CPU and on the `neuron` device, move the outputs back with `.cpu()` and compare
(integer results exactly):

* eager    : neuron eager vs CPU (assert_close, float32 tolerances, equal_nan);
* adaptive : neuron adaptive eager (`ae.adaptive()`, strategy "graph") vs CPU, and, when
             eager passes, adaptive vs eager bit for bit (adaptive_eager/README.md, "Design
             contracts": "adaptive eager gives the same values as eager mode, bit for bit
             with the default executor").

Random ops are seeded with `torch.manual_seed(0)` right before every call on both sides (it
seeds the neuron generator too), so they must produce the same values as CPU.

Expected failures live in `tests/conformance/opinfo_xfail.txt`, one line per entry:

    <mode>:<op id>   # reason        (mode is "eager", "adaptive" (graph) or "matmul")
    <op id>          # reason        (fails in every mode)

`<op id>` is the OpInfo name, plus ".<variant_test_name>" when it has one. The list is
strict both ways: a listed op that passes fails its test ("unexpected success: remove it
from opinfo_xfail.txt"), an unlisted op that fails fails its test.

After every op the test checks that the engine is still usable (a tiny eager and adaptive
computation); a failure there is a *cascading failure* (an earlier op broke the engine) and is
reported as such, never covered by the xfail list.

Run: `python -m pytest tests/conformance/test_opinfo.py -q`. The last test prints the summary
"OpInfo: N ops tested, P pass in eager, Q pass in adaptive (x%)". Print a draft xfail list
(raw first errors as reasons) with `python tests/conformance/test_opinfo.py --draft-xfail`; the checked-in
reasons are hand-written root causes, so merge by hand. `python tests/conformance/test_opinfo.py OP...`
runs single ops and prints their errors. OPINFO_SAMPLES=N changes the samples per op (the
xfail list is made for the default).
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as a script (its CLI): the repository root holds `tests`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

import adaptive_eager as ae
from tests.harness.opinfo_bar import MODES, hold_bar, report_and_hold, summary
from tests.harness.opinfo_bar import load_xfail as _load_xfail

pytest.importorskip("expecttest")  # op_db needs it
from torch.testing._internal.common_methods_invocations import SampleInput, op_db  # noqa: E402
from torch.testing._internal.common_utils import noncontiguous_like  # noqa: E402

XFAIL_FILE = Path(__file__).with_name("opinfo_xfail.txt")
DEVICE = "neuron"
# OPINFO_DTYPE=int64 (bool, bfloat16, float16, complex64...) runs the sweep in another dtype; the
# xfail list is made for float32 (CI's), so another dtype's run is read in its summary
DTYPE = getattr(torch, os.environ.get("OPINFO_DTYPE", "float32"))
# the first N samples of each op (runtime budget; the xfail list is made for the default)
SAMPLES_PER_OP = int(os.environ.get("OPINFO_SAMPLES", "5"))
SPREAD_SAMPLES = 3  # of them, run spread out too (`_spread`)
MAX_SAMPLE_NUMEL = 1 << 18  # skip samples with a bigger tensor (keeps the simulator fast)
OP_TIMEOUT_S = 30           # per-op guard (SIGALRM) against hangs
RTOL, ATOL = 1e-4, 1e-5     # float32: the executor runs CPU kernels, but allow reassociation
_TOLERANCES = {torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5)}  # by result dtype


def _tolerance(dtype):  # float64 runs as float32 (Note [float64 policy]); integers: exact
    if dtype.is_floating_point or dtype.is_complex:
        return _TOLERANCES.get(dtype, (RTOL, ATOL))
    return 0, 0

# ------------------------------------------------------------------------------------------
# Skip rules (generic; a skipped op is not counted). Each returns a reason or None.
# ------------------------------------------------------------------------------------------
#  1. float32 unsupported on CPU (complex-only, integer/bool-only ops): nothing to test.
#  2. sparse / nested / quantized / CUDA-only OpInfos, by name: these exercise other
#     layouts or other backends, not the strided neuron device.
#  3. sample inputs cannot be constructed on CPU, or there are none.
#  4. every sample uses a non-strided layout or nested tensors (inputs or CPU outputs).
#  5. the CPU reference itself raises on every sample (e.g. needs CUDA / a missing library).
#  6. every sample exceeds MAX_SAMPLE_NUMEL elements.
_SKIP_NAME = re.compile(r"(^|[._])(sparse|to_sparse|nested|quantize|quantized|cuda|_cudnn|"
                        r"jiterator|_refs)([._]|$)")


def op_id(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def is_random(op) -> bool:
    if getattr(op, "nondeterministic_seeded", False):
        return True
    return bool(re.search(r"rand|dropout|bernoulli|normal|multinomial|uniform|poisson|"
                          r"exponential|geometric|cauchy|log_normal|rrelu|randperm|"
                          r"feature_alpha", op.name))


# Ops whose result is undefined memory (empty*, new_empty*, resize_ growing a tensor): only
# metadata (shape, dtype) is compared. Found by name, and generically: the CPU reference is
# run twice and, if it is not reproducible, only metadata is compared.
_UNDEFINED_VALUES = re.compile(r"(^|[._])(new_)?empty|^resize_")


# ------------------------------------------------------------------------------------------
# Moving arguments / results
# ------------------------------------------------------------------------------------------
def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def _clone(x):
    return tree_map(lambda t: _spread_like(t, t._base.clone()) if _is_spread(t) else
                    t.clone() if _is_tensor(t) else t, x)


# Samples with their tensors spread out: every other element of a larger buffer, the gaps
# NaN (PyTorch's `noncontiguous_like`, as its test_ops' noncontiguous samples), kept so when
# cloned and moved to the device (the same strides and offset over the buffer moved whole)
_SPREAD = "_opinfo_spread"


def _is_spread(t) -> bool:
    return _is_tensor(t) and getattr(t, _SPREAD, False)


def _spread_like(t, base):
    out = base.as_strided(t.shape, t.stride(), t.storage_offset())
    setattr(out, _SPREAD, True)
    return out


def _spread(sample):
    """The sample with each tensor argument of 2+ elements spread out (None: none is)."""
    def f(t):
        if not _is_tensor(t) or t.numel() < 2 or t.requires_grad or not t.is_contiguous():
            return t
        out = noncontiguous_like(t)
        setattr(out, _SPREAD, True)
        return out
    inp, args, kwargs = tree_map(f, (sample.input, tuple(sample.args), dict(sample.kwargs)))
    if not any(_is_spread(t) for t in tree_flatten((inp, args, kwargs))[0]):
        return None
    return SampleInput(inp, args=args, kwargs=kwargs)


# Ops whose extra tensor arguments must stay on CPU, as on CUDA (only `input` is moved).
_INPUT_ONLY_TO_NEURON = {
    "tensor_split",  # tensor_indices_or_sections must be a CPU tensor
}


def _to_neuron(x):
    """Tensors (also inside lists/tuples/dicts) to neuron; a "cpu" device argument (e.g.
    `x.to("cpu")`, `device="cpu"`) becomes "neuron"."""
    def f(v):
        if _is_spread(v):
            return _spread_like(v, v._base.to(DEVICE))
        if _is_tensor(v):
            return v.to(DEVICE)
        if isinstance(v, torch.device) and v.type == "cpu":
            return torch.device(DEVICE)
        if isinstance(v, str) and v == "cpu":
            return DEVICE
        return v
    return tree_map(f, x)


def _kwargs_to_neuron(kwargs: dict) -> dict:
    out = _to_neuron(kwargs)
    if out.get("device") in ("cpu", torch.device("cpu")):
        out["device"] = DEVICE
    return out


def _to_cpu(x):
    """Move tensors back; non-tensors pass through. Each keeps the layout it had
    (`_layout`: sizes, strides, offset), which `.cpu()` may not."""
    def move(v):
        c = v.cpu()
        c._layout = (tuple(v.shape), v.stride(), v.storage_offset())
        return c
    return tree_map(lambda v: move(v) if _is_tensor(v) else v, x)


def _layout(t) -> tuple:
    return getattr(t, "_layout", None) or (tuple(t.shape), t.stride(), t.storage_offset())


def _significant_strides(t) -> tuple:
    """Strides of the dims of size > 1 (others are free), or None for an empty tensor."""
    shape, stride, _ = _layout(t)
    return None if 0 in shape else tuple(st for n, st in zip(shape, stride) if n > 1)


def _devices(x) -> list:
    leaves, _ = tree_flatten(x)
    return [v.device.type for v in leaves if _is_tensor(v)]


def _numel_ok(sample) -> bool:
    leaves, _ = tree_flatten((sample.input, sample.args, sample.kwargs))
    return all(v.numel() <= MAX_SAMPLE_NUMEL for v in leaves if _is_tensor(v))


def _strided(x) -> bool:
    leaves, _ = tree_flatten(x)
    return all(v.layout == torch.strided and not v.is_nested and not v.is_quantized
               for v in leaves if _is_tensor(v))


# ------------------------------------------------------------------------------------------
# Comparison
# ------------------------------------------------------------------------------------------
class Mismatch(AssertionError):
    pass


def compare(actual, expected, *, exact: bool = False, meta_only: bool = False,
            what: str = "output", strides: bool = True) -> None:
    a_leaves, a_spec = tree_flatten(actual)
    e_leaves, e_spec = tree_flatten(expected)
    if len(a_leaves) != len(e_leaves):
        raise Mismatch(f"{what} structure differs: {a_spec} vs {e_spec}")
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        where = f"{what} {i}"
        if _is_tensor(e):
            if not _is_tensor(a):
                raise Mismatch(f"{where}: expected a tensor, got {type(a).__name__}")
            if a.shape != e.shape:
                raise Mismatch(f"{where}: shape {tuple(a.shape)} != {tuple(e.shape)}")
            # Note [float64 policy]: float64 runs as float32 on neuron (the reference's).
            if a.dtype != e.dtype and not (e.dtype == torch.float64 and a.dtype == torch.float32):
                raise Mismatch(f"{where}: dtype {a.dtype} != {e.dtype}")
            # CPU's strides (issue 8: view-versus-copy semantics follow them); a clone may
            # lay a non-dense output out anew
            if strides and what != "clone of output" and \
                    _significant_strides(a) != _significant_strides(e):
                raise Mismatch(f"{where}: strides {_layout(a)[1]} != {_layout(e)[1]}")
            if meta_only:
                continue
            if a.dtype != e.dtype:
                e = e.to(a.dtype)
            try:
                if exact:
                    torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)
                else:
                    rtol, atol = _tolerance(e.dtype)
                    torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)
            except AssertionError as exc:
                msg = str(exc).strip().splitlines()
                raise Mismatch(f"{where}: values differ: " + " ".join(msg[:4])) from None
        elif isinstance(e, torch.device) or (isinstance(e, str) and e == "cpu"):
            continue  # a device argument: differs by construction
        elif type(a) is not type(e):
            raise Mismatch(f"{where}: expected a {type(e).__name__}, got {type(a).__name__}")
        elif isinstance(e, float):
            if not (math.isclose(a, e, rel_tol=RTOL, abs_tol=ATOL)
                    or (math.isnan(a) and math.isnan(e))):
                raise Mismatch(f"{where}: {a!r} != {e!r}")
        else:
            # A leaf that cannot be compared is a failure, never a pass (issue 9.8).
            try:
                same = bool(a == e)
            except Exception as exc:  # noqa: BLE001
                raise Mismatch(f"{where}: cannot compare {type(e).__name__} values "
                               f"({_short(exc)})") from None
            if not same:
                raise Mismatch(f"{where}: {a!r} != {e!r}")


# ------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------
class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: int):
    if seconds <= 0 or not hasattr(signal, "SIGALRM") or \
            __import__("threading").current_thread() is not __import__("threading").main_thread():
        yield
        return

    def handler(signum, frame):
        raise _Timeout(f"timed out after {seconds}s")
    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _call(fn, sample, random: bool):
    inp, args, kwargs = sample
    if random:
        torch.manual_seed(0)
    return fn(inp, *args, **kwargs)


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    text = text.splitlines()[0] if text else type(exc).__name__
    return text[:300]


@dataclass
class OpResult:
    op_id: str
    skipped: str | None = None               # reason if skipped (not counted)
    errors: dict = field(default_factory=dict)  # mode -> first failure message
    samples: int = 0
    seconds: float = 0.0

    def passed(self, mode: str) -> bool:
        return self.skipped is None and mode not in self.errors


def _lazy_clone(x):
    """Adaptive mode only: route contiguous tensor inputs through a pending `clone`, so the
    op reads values produced inside the same flush (exercises the lazy queue and fusion,
    not just a one-op flush)."""
    return tree_map(lambda t: t.clone() if _is_tensor(t) and t.is_contiguous() else t, x)


def _run_neuron(op, fn, sample, random: bool, mode: str):
    """Returns (outputs, inputs after the call, output clones or None) on CPU, and the device
    types of the outputs."""
    inp, args, kwargs = sample
    if op.name in _INPUT_ONLY_TO_NEURON:
        s = (_to_neuron(inp), args, kwargs)
    else:
        s = (_to_neuron(inp), _to_neuron(args), _kwargs_to_neuron(kwargs))
    if mode in ("adaptive", "matmul", "inductor"):
        executor = "inductor" if mode == "inductor" else ae.config.executor
        with ae.override(executor=executor), \
                ae.adaptive(strategy="matmul" if mode == "matmul" else "graph"):
            s = _lazy_clone(s)
            out = _call(fn, s, random)
            devs = _devices(out)
            # an epilogue in the same flush: clones of the outputs
            clones = tree_map(lambda t: t.clone() if _is_tensor(t) else t, out)
            res = _to_cpu((out, s, clones))
        return res, devs
    out = _call(fn, s, random)
    devs = _devices(out)
    clones = tree_map(lambda t: t.clone() if _is_tensor(t) else t, out)
    return _to_cpu((out, s, clones)), devs


def _samples(op):
    """Materialize up to SAMPLES_PER_OP usable samples, or return a skip reason (str)."""
    if DTYPE not in op.supported_dtypes("cpu"):
        return f"{DTYPE} not supported on CPU"
    if _SKIP_NAME.search(op.name):
        return "sparse/nested/quantized/CUDA-specific OpInfo"
    return usable_samples(op, False, SAMPLES_PER_OP, _numel_ok)


def usable_samples(op, requires_grad: bool, limit: int, numel_ok):
    """The op's first `limit` strided samples that `numel_ok` accepts (of at most 20 looked
    at), or a skip reason (str). Shared with the backward test."""
    torch.manual_seed(0)
    try:
        out, seen, reasons = [], 0, set()
        for s in op.sample_inputs("cpu", DTYPE, requires_grad=requires_grad):
            seen += 1
            if not _strided((s.input, s.args, s.kwargs)):
                reasons.add("non-strided layout")
            elif not numel_ok(s):
                reasons.add("sample too big")
            else:
                out.append(s)
            if len(out) >= limit or seen >= 20:
                break
    except Exception as exc:  # noqa: BLE001
        return f"sample inputs cannot be constructed: {_short(exc)}"
    if not out:
        return "no usable sample (" + (", ".join(sorted(reasons)) or "none") + ")"
    return out


def run_op(op, modes=MODES, run=None, timeout_s: float = OP_TIMEOUT_S) -> OpResult:
    """One op in every mode, within `timeout_s`; `run(op, res, modes)` fills the result (this
    file's `_run_op` by default; the backward test passes its own)."""
    res = OpResult(op_id(op))
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with _time_limit(timeout_s):
                (run or _run_op)(op, res, modes)
        except _Timeout as exc:
            for m in modes:
                res.errors.setdefault(m, f"{exc}")
    res.seconds = time.perf_counter() - t0
    return res


def _variants(op):
    """The function variant and, when the OpInfo has them, the in-place variant (`x.add_`)
    and the `out=` variants (`_into_out`)."""
    out = [("", op.op)]
    if op.inplace_variant is not None:
        out.append(("[inplace] ", op.inplace_variant))
    if op.supports_out:
        out.append(("[out] ", _into_out(op.op)))
        out.append(("[out, resized] ", _into_out(op.op, empty=True)))
    return out


def _cpu(x):  # (copies: the op may write its arguments)
    return tree_map(lambda t: t.to("cpu", copy=True) if _is_tensor(t) else t, x)


def _into_out(fn, empty: bool = False):
    """`fn` called with `out=` tensors that are every other element of a larger buffer filled
    with 7s (as PyTorch's device tests write into views), or (`empty`) of no element, which
    the op resizes: returns the result, the out
    tensors, the buffers (so a write past a view, or a skipped one, shows) and whether the
    result is the out tensors themselves, as CPU returns them. The out tensors' shapes and
    dtypes are the function's result on CPU copies of the arguments (the CPU generator
    restored after it, so a random op draws the same values on each side; on CPU, the values
    the out= form must give)."""
    def call(inp, *args, **kwargs):
        tensors = [t for t in tree_flatten((inp, args, kwargs))[0] if _is_tensor(t)]
        if not tensors:  # (factories: test_out_views.py)
            raise TypeError("the out= variant is tried on ops with tensor arguments")
        with torch.random.fork_rng(devices=[]):
            like = fn(*_cpu((inp,) + args), **_cpu(kwargs))
        leaves, spec = tree_flatten(like)
        if not leaves or not all(_is_tensor(t) for t in leaves):
            raise TypeError("the out= variant needs a tensor result")
        device = (inp if _is_tensor(inp) else tensors[0]).device
        if empty:
            bufs = [torch.empty(0, dtype=t.dtype, device=device) for t in leaves]
            outs = bufs
        else:
            bufs = [torch.full((2 * t.numel() + 1,), 7, dtype=t.dtype, device=device)
                    for t in leaves]
            outs = [b[1::2].view(t.shape) for b, t in zip(bufs, leaves)]
        res = fn(inp, *args, out=outs[0] if _is_tensor(like) else
                 spec.unflatten(outs) if isinstance(like, tuple) else outs, **kwargs)
        same = all(r is o for r, o in zip(tree_flatten(res)[0], outs))
        if device.type == "cpu":  # the reference: CPU's out= kernel must agree with its
            try:  # functional form, else the sample is not CPU's to judge by (PyTorch 2.13's
                compare(outs, leaves, strides=False)  # gelu.out leaves a strided out unwritten)
            except Mismatch as exc:
                raise RuntimeError(f"CPU's out= form differs from its function: {exc}") from None
        return res, outs, bufs, same
    return call


def _run_op(op, res: OpResult, modes) -> None:
    samples = _samples(op)
    if isinstance(samples, str):
        res.skipped = samples
        return
    random = is_random(op)
    cpu_ok = 0
    for si, sample in enumerate(samples):
        for tag, fn in _variants(op):
            ok = _run_sample(op, fn, tag, si, sample, random, res, modes)
            if not tag:
                cpu_ok += ok
        spread = _spread(sample) if si < SPREAD_SAMPLES else None  # the same op reading
        # (and writing) strided views
        for tag, fn in _variants(op) if spread is not None else ():
            if tag.startswith("[out"):
                continue
            _run_sample(op, fn, "[spread] " + tag, si, spread, random, res, modes)
    res.samples = cpu_ok
    if cpu_ok == 0:
        res.skipped = "CPU reference fails on every sample"
        res.errors.clear()


def _run_sample(op, fn, tag, si, sample, random, res, modes) -> bool:
    """One sample, one variant, every mode. Returns False if CPU cannot run it."""
    # CPU reference (outputs, and inputs after the call: some ops write into them), run
    # twice: if it is not reproducible (uninitialized memory), compare metadata only.
    try:
        s1, s2 = _clone_sample(sample), _clone_sample(sample)
        expected = _to_cpu((_call(fn, s1, random), s1))
        again = _to_cpu((_call(fn, s2, random), s2))
    except Exception:  # noqa: BLE001  the op does not run on CPU with this sample
        return False
    if not _strided(expected):
        return False
    try:
        compare(again, expected, exact=True)
        meta_only = bool(_UNDEFINED_VALUES.search(op.name))
    except Mismatch:
        meta_only = True
    # Some CPU kernels (LAPACK gelsy, ...) give other bits for a differently aligned input:
    # then "adaptive == eager bit for bit" cannot hold either, and is checked with tolerance.
    # linalg.lstsq (gelsy) is known to be alignment-sensitive; the probe below can miss it
    # when both allocations happen to share an alignment.
    bitwise = not meta_only and not op.name.startswith("linalg.lstsq")
    if bitwise:
        try:
            s3 = _misaligned_sample(sample)
            compare(_to_cpu((_call(fn, s3, random), s3)), expected, exact=True)
        except Exception:  # noqa: BLE001
            bitwise = False
    eager = None
    for mode in modes:
        if mode in res.errors:
            continue
        try:
            (out, inputs, clones), devs = _run_neuron(op, fn, _clone_sample(sample), random,
                                                      mode)
            if any(d != DEVICE for d in devs):
                raise Mismatch(f"output on device {devs} (expected all on {DEVICE})")
            compare(out, expected[0], meta_only=meta_only)
            compare(inputs, expected[1], meta_only=meta_only, what="input")
            # inductor: float tolerance, not bit for bit (fusion/README.md, "Executors")
            exact = mode != "inductor"
            compare(clones, out, exact=exact, meta_only=meta_only, what="clone of output")
            if mode == "eager":
                eager = (out, inputs)
            elif eager is not None and not meta_only:
                try:
                    compare(out, eager[0], exact=bitwise and exact)
                    compare(inputs, eager[1], exact=bitwise and exact, what="input")
                except Mismatch as exc:
                    raise Mismatch(f"adaptive != eager bit for bit: {exc}") from None
        except _Timeout:
            raise
        except Exception as exc:  # noqa: BLE001
            res.errors[mode] = f"{tag}sample {si}: {_short(exc)}"
    return True


def _misaligned_sample(sample):
    """Like _clone_sample, but contiguous tensors start one element into their storage."""
    def f(t):
        if not _is_tensor(t) or not t.is_contiguous() or t.numel() == 0:
            return t.clone() if _is_tensor(t) else t
        buf = torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
        return buf.copy_(t)
    return tree_map(f, sample.input), tree_map(f, tuple(sample.args)), \
        tree_map(f, dict(sample.kwargs))


def _clone_sample(sample):
    """(input, args, kwargs) with fresh tensors (ops may write into their inputs)."""
    return _clone(sample.input), _clone(tuple(sample.args)), _clone(dict(sample.kwargs))


def engine_healthy() -> str | None:
    """A tiny computation in both modes; returns an error text if the engine is broken."""
    try:
        if ae.is_adaptive():
            return "adaptive mode left on after the op"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            x = torch.arange(6, dtype=torch.float32).to(DEVICE)
            if (x * 2 + 1).sum().item() != 36.0:
                return "eager: wrong value for (x*2+1).sum()"
            with ae.adaptive():
                y = (x.view(2, 3) * 2 + 1).relu().sum(0)
                v = y.cpu()
            if v.tolist() != [8.0, 12.0, 16.0]:
                return f"adaptive: wrong value {v.tolist()}"
    except Exception as exc:  # noqa: BLE001
        return _short(exc)
    return None


# ------------------------------------------------------------------------------------------
# The expected-failure list
# ------------------------------------------------------------------------------------------
def load_xfail(path: Path = XFAIL_FILE) -> dict:
    """{(mode, op_id): reason}; a bare op id expands to every mode."""
    return _load_xfail(path, MODES)


XFAIL = load_xfail() if DTYPE == torch.float32 else {}  # (made for float32)
OPS = sorted(op_db, key=op_id)
_ids = [op_id(op) for op in OPS]
assert len(set(_ids)) == len(_ids), "duplicate OpInfo ids"
_unknown = {name for (_, name) in XFAIL} - set(_ids)
RESULTS: dict[str, OpResult] = {}
_PROCESS_T0 = time.perf_counter()


def setup_module(module):
    ae.set_strategy("graph")
    ae.set_adaptive(False)


@pytest.mark.filterwarnings("ignore")
def test_xfail_file_names_exist():
    assert not _unknown, f"opinfo_xfail.txt names unknown ops: {sorted(_unknown)}"


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_opinfo(op):
    ae.set_strategy("graph")
    res = run_op(op)
    RESULTS[res.op_id] = res
    judge(res, XFAIL, XFAIL_FILE.name)


def judge(res, xfail: dict, xfail_name: str, modes=MODES) -> None:
    """Pass, skip or fail one op's test: the engine must still work, and failures must be
    exactly the ones `xfail` lists (both ways), in `modes`. Shared by the forward and
    backward tests and the optimizer suite."""
    health = engine_healthy()
    if health is not None:
        ae.set_adaptive(False)
        pytest.fail(f"CASCADING FAILURE: the engine is unusable after {res.op_id}: {health}")
    if res.skipped:
        stale = [m for m in modes if (m, res.op_id) in xfail]
        if stale:
            pytest.fail(f"{res.op_id} is skipped ({res.skipped}) but listed in "
                        f"{xfail_name} for {stale}: remove it")
        pytest.skip(res.skipped)
    problems = []
    for mode in modes:
        listed = (mode, res.op_id) in xfail
        failed = mode in res.errors
        if failed and not listed:
            problems.append(f"[{mode}] {res.errors[mode]}")
        elif listed and not failed:
            problems.append(f"[{mode}] unexpected success: remove it from {xfail_name} "
                            f"(listed as: {xfail[(mode, res.op_id)]})")
    if problems:
        pytest.fail(f"{res.op_id}: " + "; ".join(problems), pytrace=False)


# The OpInfo forward test under the Inductor executor (adaptive, graph strategy): each
# sample's clone -> op -> clone group is compiled by TorchInductor and compared with CPU
# within RTOL/ATOL. CI runs these few ops on their first sample (compiles take seconds);
# `python tests/conformance/test_opinfo.py --inductor` runs every op (hours).
INDUCTOR_OPS = ("add", "mul", "nn.functional.gelu", "softmax")


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("op", [op for op in OPS if op_id(op) in INDUCTOR_OPS],
                         ids=lambda op: op_id(op))
def test_opinfo_inductor(op, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "SAMPLES_PER_OP", 1)
    monkeypatch.setattr(sys.modules[__name__], "OP_TIMEOUT_S", 900)
    ae.reset_metrics()
    res = run_op(op, modes=("eager", "inductor"))
    assert res.skipped is None, res.skipped
    assert not res.errors, res.errors
    assert ae.metrics().compiled_launches > 0  # the group really ran Inductor's code


@pytest.fixture(scope="module", autouse=True)
def _pass_rate_bar(request):
    """The pass rate over the ops this module ran, printed, and held to the issue's bar (99.5%
    of the ops tested, in each mode) once at least 100 ops ran (tests/harness/opinfo_bar.py)."""
    yield
    report_and_hold(request, RESULTS, "OpInfo", _PROCESS_T0)


def test_the_bar_fails_below_99_5_percent_and_only_on_100_ops():
    """hold_bar itself: 1 failure in 100 ops misses the bar; 1 in 200 meets it; a run of
    fewer than 100 ops is not held to it."""
    def results(n, failing):
        return {f"op{i}": OpResult(f"op{i}", errors={"eager": "x"} if i < failing else {})
                for i in range(n)}
    with pytest.raises(AssertionError, match=r"eager: 99.0% of 100 ops pass \(bar: 99.5%\)"):
        hold_bar(results(100, 1))
    hold_bar(results(200, 1))
    hold_bar(results(99, 50))


# ------------------------------------------------------------------------------------------
# CLI: python tests/conformance/test_opinfo.py [--draft-xfail] [op ids...]
# ------------------------------------------------------------------------------------------
def _main(argv) -> int:
    write = "--draft-xfail" in argv
    modes = ("eager", "inductor") if "--inductor" in argv else MODES
    names = [a for a in argv if not a.startswith("--")]
    ae.set_strategy("graph")
    results = {}
    for op in OPS:
        if names and op_id(op) not in names:
            continue
        r = run_op(op, modes)
        results[r.op_id] = r
        h = engine_healthy()
        status = "SKIP " + r.skipped if r.skipped else \
            ("ok" if not r.errors else "; ".join(f"{m}: {e}" for m, e in r.errors.items()))
        print(f"{r.seconds:6.2f}s n={r.samples} {r.op_id}: {status}" + (f"  !!HEALTH: {h}" if h else ""),
              flush=True)
    if "--inductor" in argv:
        tested = [r for r in results.values() if r.skipped is None]
        print(f"OpInfo under the inductor executor: {len(tested)} ops tested, "
              f"{sum(r.passed('eager') for r in tested)} pass in eager, "
              f"{sum(r.passed('inductor') for r in tested)} pass under inductor")
    else:
        print(summary(results))
    if write:
        lines = []
        for r in results.values():
            if r.skipped or not r.errors:
                continue
            if set(r.errors) == set(MODES) and r.errors["eager"].split(": ", 1)[-1] == \
                    r.errors["adaptive"].split(": ", 1)[-1]:
                lines.append(f"{r.op_id}  # {r.errors['eager']}")
            else:
                for m, e in r.errors.items():
                    lines.append(f"{m}:{r.op_id}  # {e}")
        print("# draft for opinfo_xfail.txt:")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
