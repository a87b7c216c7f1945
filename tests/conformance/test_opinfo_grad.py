"""OpInfo backward differential test: gradients on CPU vs neuron eager vs neuron adaptive.

For every OpInfo of PyTorch's `op_db` that supports autograd in float32 on CPU, we take the
first `SAMPLES_PER_OP` sample inputs built with `requires_grad=True` and, on CPU and on the
`neuron` device (eager, adaptive graph, adaptive matmul):

1. make every tensor input a fresh leaf (same `requires_grad` as the sample's);
2. call the op's function variant through `op.gradcheck_wrapper` and
   `sample.output_process_fn_grad` (as PyTorch's own test_ops.py gradient tests do);
3. weight every floating output leaf that requires grad with a fixed random tensor
   (seeded, generated on CPU, the same on both sides) and take `loss = sum((w * out).sum())`
   (a complex output is weighted through `view_as_real`);
4. `torch.autograd.grad(loss, inputs, allow_unused=True)` over every input requiring grad.

The gradients are moved to CPU and compared with the CPU ones (float32 tolerances,
equal_nan). `None` (an input the loss does not depend on) is compared strictly: neuron must
give `None` exactly where CPU does; a tensor where CPU has `None` (or the reverse) is a
failure. In adaptive mode the gradients must also equal eager's bit for bit, unless the CPU
reference itself is alignment-sensitive (probed as in test_opinfo.py).

A sample is not counted when CPU cannot run it, or when none of its outputs or inputs take
part in autograd, or when every CPU gradient is None (nothing to differentiate); an op with
no counted sample is skipped with that reason. A sample whose CPU gradients are not reproducible (run twice) is a failure of the op:
a leaf that cannot be compared never passes.

Expected failures live in `tests/conformance/opinfo_grad_xfail.txt`, in the format of
`tests/conformance/opinfo_xfail.txt` (strict both ways). Run:

    python -m pytest tests/conformance/test_opinfo_grad.py -q

The last test prints "OpInfo backward: N ops tested, P pass in eager (..%), ...".
`python tests/conformance/test_opinfo_grad.py [--draft-xfail] [--from=OP] [OP...]` runs ops from the
command line. A mode listed with a reason starting "CRASH" (it aborts the process) runs in a
child process instead, so a crash fails that op only.
OPINFO_GRAD_SAMPLES=N changes the samples per op (the xfail list is made for the default).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a script (its CLI): the repository root holds `tests`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

import adaptive_eager as ae
from tests.harness.opinfo_bar import report_and_hold, summary

pytest.importorskip("expecttest")  # op_db needs it
from tests.conformance import test_opinfo as fwd  # noqa: E402  the forward test's machinery
from tests.conformance.test_opinfo import (DEVICE, DTYPE, MODES, Mismatch, OpResult, _is_tensor,  # noqa: E402
                         _short, _Timeout, compare, engine_healthy,
                         is_random, op_id)

XFAIL_FILE = Path(__file__).with_name("opinfo_grad_xfail.txt")
SAMPLES_PER_OP = int(os.environ.get("OPINFO_GRAD_SAMPLES", "2"))
MAX_SAMPLE_NUMEL = 1 << 14  # smaller than the forward test's: backward costs several ops
OP_TIMEOUT_S = 30
WEIGHT_SEED = 1234


# ------------------------------------------------------------------------------------------
# Samples
# ------------------------------------------------------------------------------------------
def _numel_ok(sample) -> bool:
    leaves, _ = tree_flatten((sample.input, sample.args, sample.kwargs))
    return all(v.numel() <= MAX_SAMPLE_NUMEL for v in leaves if _is_tensor(v))


def _samples(op):
    """Up to SAMPLES_PER_OP usable samples with requires_grad inputs, or a skip reason."""
    if not op.supports_autograd:
        return "no autograd support (supports_autograd=False)"
    if DTYPE not in op.supported_backward_dtypes("cpu"):
        return "float32 backward not supported on CPU"
    if fwd._SKIP_NAME.search(op.name):
        return "sparse/nested/quantized/CUDA-specific OpInfo"
    return fwd.usable_samples(op, True, SAMPLES_PER_OP, _numel_ok)


def _leaves(sample, device: str, misaligned: bool = False, input_only: bool = False):
    """(input, args, kwargs) as fresh leaves on `device`, keeping each tensor's requires_grad;
    also the list of leaves requiring grad, in flattening order."""
    wrt = []

    def f(t):
        if not _is_tensor(t):  # a "cpu" device argument (x.to("cpu")) becomes `device`
            if device != "cpu" and isinstance(t, torch.device) and t.type == "cpu":
                return torch.device(device)
            if device != "cpu" and isinstance(t, str) and t == "cpu":
                return device
            return t
        v = t.detach()
        if misaligned and v.is_contiguous() and v.numel():
            v = torch.empty(v.numel() + 1, dtype=v.dtype)[1:].view(v.shape).copy_(v)
        else:
            v = v.to(device, copy=True)
        if t.requires_grad:
            v.requires_grad_(True)
            wrt.append(v)
        return v
    if input_only:  # extra tensor arguments stay on CPU, as on CUDA (see test_opinfo.py)
        s = (tree_map(f, sample.input), tuple(sample.args), dict(sample.kwargs))
    else:
        s = (tree_map(f, sample.input), tree_map(f, tuple(sample.args)),
             tree_map(f, dict(sample.kwargs)))
    if device != "cpu" and s[2].get("device") in ("cpu", torch.device("cpu")):
        s[2]["device"] = device
    return s, wrt


# ------------------------------------------------------------------------------------------
# Loss and gradients
# ------------------------------------------------------------------------------------------
def weights_for(outputs) -> list:
    """One fixed random CPU tensor per output leaf (None where the leaf is not weighted):
    seeded, so CPU and neuron get the same weights."""
    gen = torch.Generator().manual_seed(WEIGHT_SEED)
    out = []
    for v in tree_flatten(outputs)[0]:
        if _is_tensor(v) and v.requires_grad and (v.is_floating_point() or v.is_complex()):
            shape = v.shape + ((2,) if v.is_complex() else ())
            out.append(torch.randn(shape, generator=gen, dtype=torch.float32))
        else:
            out.append(None)
    return out


def weighted_loss(outputs, weights):
    terms = []
    for v, w in zip(tree_flatten(outputs)[0], weights):
        if w is None:
            continue
        if v.is_complex():
            v = torch.view_as_real(v.resolve_conj())
        terms.append((w.to(v.device, v.dtype) * v).sum())
    return torch.stack(terms).sum() if len(terms) > 1 else terms[0]


def _forward(op, sample, s, random: bool):
    inp, args, kwargs = s
    if random:
        torch.manual_seed(0)
    return sample.output_process_fn_grad(op.gradcheck_wrapper(op.op, inp, *args, **kwargs))


def grads(op, sample, device: str, random: bool, misaligned: bool = False):
    """The gradients (on CPU, None kept) of the weighted loss, or None when there is nothing
    to differentiate (no input or no output takes part in autograd)."""
    s, wrt = _leaves(sample, device, misaligned,
                     input_only=device != "cpu" and op.name in fwd._INPUT_ONLY_TO_NEURON)
    if not wrt:
        return None
    out = _forward(op, sample, s, random)
    w = weights_for(out)
    if all(x is None for x in w):
        return None
    loss = weighted_loss(out, w)
    g = torch.autograd.grad(loss, wrt, allow_unused=True)
    devs = [t.device.type for t in tree_flatten(out)[0] + list(g) if _is_tensor(t)]
    if any(d != torch.device(device).type for d in devs):
        raise Mismatch(f"outputs and gradients on devices {devs}, expected all on {device}")
    return fwd._to_cpu(list(g))  # each keeps its device layout (compared with CPU's)


# Gradients whose layout PyTorch's own backward changes under Python dispatch (any
# TorchDispatchMode on plain CPU gives the same): compared by value, not strides.
_LAYOUT_UNDER_PYTHON_DISPATCH = {"ormqr"}  # (1, 5) on plain CPU, (5, 1) under a mode


def compare_grads(actual, expected, *, exact: bool = False, strides: bool = True) -> None:
    """Gradient lists; None must match None exactly (a None is never equal to a tensor)."""
    if len(actual) != len(expected):
        raise Mismatch(f"{len(actual)} gradients, expected {len(expected)}")
    for i, (a, e) in enumerate(zip(actual, expected)):
        if (a is None) != (e is None):
            raise Mismatch(f"grad {i}: {'None' if a is None else 'a tensor'}, expected "
                           f"{'None' if e is None else 'a tensor'} (allow_unused)")
        if e is not None:
            compare(a, e, exact=exact, what=f"grad {i}", strides=strides)


# ------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------
def _run_neuron(op, sample, random: bool, mode: str):
    if mode == "eager":
        return grads(op, sample, DEVICE, random)
    with ae.adaptive(strategy="graph" if mode == "adaptive" else "matmul"):
        return grads(op, sample, DEVICE, random)


def _run_sample(op, si, sample, random, res: OpResult, modes) -> bool:
    """One sample, every mode. Returns False if the sample is not counted."""
    try:
        expected = grads(op, sample, "cpu", random)
    except Exception:  # noqa: BLE001  the op (or its backward) does not run on CPU
        return False
    if expected is None or all(e is None for e in expected):
        return False  # nothing to differentiate: all-None gradients would compare vacuously
    try:
        again = grads(op, sample, "cpu", random)
        compare_grads(again, expected, exact=True)
    except Exception as exc:  # noqa: BLE001
        for m in modes:
            res.errors.setdefault(m, f"sample {si}: CPU gradients not reproducible, cannot "
                                     f"compare: {_short(exc)}")
        return True
    bitwise = not op.name.startswith("linalg.lstsq")  # see test_opinfo.py
    if bitwise:
        try:
            compare_grads(grads(op, sample, "cpu", random, misaligned=True), expected,
                          exact=True)
        except Exception:  # noqa: BLE001
            bitwise = False
    eager = None
    for mode in modes:
        if mode in res.errors:
            continue
        try:
            got = _run_neuron(op, sample, random, mode)
            if got is None:
                raise Mismatch("no output requires grad on neuron (CPU's do)")
            compare_grads(got, expected, strides=op.name not in _LAYOUT_UNDER_PYTHON_DISPATCH)
            if mode == "eager":
                eager = got
            elif eager is not None:
                try:
                    compare_grads(got, eager, exact=bitwise)
                except Mismatch as exc:
                    raise Mismatch(f"adaptive != eager bit for bit: {exc}") from None
        except _Timeout:
            raise
        except Exception as exc:  # noqa: BLE001
            res.errors[mode] = f"sample {si}: {_short(exc)}"
    return True


def _run_op(op, res: OpResult, modes) -> None:
    samples = _samples(op)
    if isinstance(samples, str):
        res.skipped = samples
        return
    random = is_random(op)
    for si, sample in enumerate(samples):
        res.samples += _run_sample(op, si, sample, random, res, modes)
    if res.samples == 0:
        res.skipped = "no sample to differentiate (CPU fails, or no input/output needs grad)"
        res.errors.clear()


def run_op(op, modes=MODES) -> OpResult:
    return fwd.run_op(op, modes, _run_op, OP_TIMEOUT_S)


# A mode of an op that kills the process (an abort on autograd's device thread) is listed
# with a reason starting "CRASH": that mode runs in a child process (this file's CLI), so the
# session survives and a fix still shows up as an unexpected success.
CRASH_TAG = "CRASH"
CHILD_TIMEOUT_S = 120


def run_op_isolated(op, modes=MODES) -> OpResult:
    """run_op, one child process per mode; a child that dies fails its mode."""
    res = OpResult(op_id(op))
    t0 = time.perf_counter()
    for mode in modes:
        try:
            proc = subprocess.run([sys.executable, __file__, "--json", f"--modes={mode}",
                                   op_id(op)], capture_output=True, text=True,
                                  timeout=CHILD_TIMEOUT_S, env=dict(os.environ))
        except subprocess.TimeoutExpired:
            res.errors[mode] = f"child process timed out after {CHILD_TIMEOUT_S}s"
            continue
        line = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode != 0 or not line:
            err = [x for x in proc.stderr.splitlines() if x.strip()
                   and "registered at" not in x]
            res.errors[mode] = (f"process died (exit code {proc.returncode}): "
                                + (err[-1][:200] if err else "no message"))
            continue
        child = json.loads(line[-1])
        res.skipped = child["skipped"]
        res.samples = max(res.samples, child["samples"])
        res.errors.update(child["errors"])
    res.seconds = time.perf_counter() - t0
    return res


def run_op_guarded(op, modes=MODES) -> OpResult:
    """run_op, with the modes listed as CRASH for this op run in child processes."""
    crash = [m for m in modes if XFAIL.get((m, op_id(op)), "").startswith(CRASH_TAG)]
    res = run_op(op, tuple(m for m in modes if m not in crash))
    if crash and not res.skipped:
        iso = run_op_isolated(op, crash)
        res.errors.update(iso.errors)
        res.seconds += iso.seconds
    return res


# ------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------
XFAIL = fwd.load_xfail(XFAIL_FILE)
OPS = fwd.OPS
_ids = [op_id(op) for op in OPS]
_unknown = {name for (_, name) in XFAIL} - set(_ids)
RESULTS: dict[str, OpResult] = {}
_PROCESS_T0 = time.perf_counter()


@pytest.mark.filterwarnings("ignore")
def test_grad_xfail_file_names_exist():
    assert not _unknown, f"opinfo_grad_xfail.txt names unknown ops: {sorted(_unknown)}"


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("op", OPS, ids=_ids)
def test_opinfo_grad(op):
    ae.set_strategy("graph")
    res = run_op_guarded(op)
    RESULTS[res.op_id] = res
    fwd.judge(res, XFAIL, "opinfo_grad_xfail.txt")


@pytest.fixture(scope="module", autouse=True)
def _pass_rate_bar(request):
    """The pass rate over the ops this module ran, printed and held to the bar after its last
    test, whatever the order (as test_opinfo.py's fixture)."""
    yield
    report_and_hold(request, RESULTS, "OpInfo backward", _PROCESS_T0)


# ------------------------------------------------------------------------------------------
# CLI: python tests/conformance/test_opinfo_grad.py [--draft-xfail] [op ids...]
# ------------------------------------------------------------------------------------------
def _main(argv) -> int:
    write = "--draft-xfail" in argv
    names = [a for a in argv if not a.startswith("--")]
    start = next((a.split("=", 1)[1] for a in argv if a.startswith("--from=")), None)
    modes = next((tuple(a.split("=", 1)[1].split(",")) for a in argv
                  if a.startswith("--modes=")), MODES)
    ae.set_strategy("graph")
    results = {}
    for op in OPS:
        if names and op_id(op) not in names or start and op_id(op) < start:
            continue
        child = "--json" in argv  # run_op_isolated's child: runs what it is asked
        r = run_op(op, modes) if child else run_op_guarded(op, modes)
        if child:  # one line per op
            print(json.dumps({"skipped": r.skipped, "samples": r.samples,
                              "errors": r.errors}), flush=True)
            continue
        results[r.op_id] = r
        h = engine_healthy()
        status = "SKIP " + r.skipped if r.skipped else \
            ("ok" if not r.errors else "; ".join(f"{m}: {e}" for m, e in r.errors.items()))
        print(f"{r.seconds:6.2f}s n={r.samples} {r.op_id}: {status}"
              + (f"  !!HEALTH: {h}" if h else ""), flush=True)
    print(summary(results, "OpInfo backward"))
    if write:
        print("# draft for opinfo_grad_xfail.txt:")
        for r in results.values():
            if r.skipped or not r.errors:
                continue
            if set(r.errors) == set(MODES):
                print(f"{r.op_id}  # {r.errors['eager']}")
            else:
                for m, e in r.errors.items():
                    print(f"{m}:{r.op_id}  # {e}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
