"""ModuleInfo differential test: nn modules on CPU vs neuron eager vs neuron adaptive.

For every ModuleInfo of PyTorch's `module_db` (float32), in training mode and, when the
ModuleInfo says training and eval differ, in eval mode too, we take up to
`SAMPLES_PER_MODULE` of its module inputs (built with `requires_grad=True`; spread over the
list, the first always, so a module with 105 inputs is not tested on 3 variants of one) and:

1. build the module on CPU after `torch.manual_seed(0)` (a lazy module gets its dry run on
   CPU: adaptive_eager/LIMITS.md, lazy modules are initialized on the CPU before moving);
2. copy it with `.to("neuron")` (same parameters and buffers) and make every forward tensor
   argument a fresh leaf on the device (same `requires_grad` as the sample's);
3. run the forward after `torch.manual_seed(0)` (dropout inside transformers, the random
   init of a lazy module), then the backward of a weighted sum of every floating output that
   requires grad (fixed random CPU weights, test_opinfo_grad.py's: a plain sum hides the
   gradient of softmax-like outputs, whose sum is constant);
4. move back and compare with CPU: outputs, input gradients, parameter gradients (None
   strictly: neuron must give None exactly where CPU does), and the buffers and parameters
   after the step (BatchNorm's running statistics).

Comparisons are test_opinfo.py's (float32 tolerances, equal_nan, CPU's strides). Adaptive mode
(`ae.adaptive()`, "graph" and "matmul" strategies: the module's copy, forward, backward and
reads all queued in one scope) must also equal eager bit for bit. The CPU reference is run
twice; a module whose CPU results are not reproducible fails (nothing to compare with).

Expected failures live in `tests/conformance/modules_xfail.txt`, in the format of
`opinfo_xfail.txt` (`<mode>:<module name>  # reason`, or `<module name>  # reason` for every
mode), strict both ways; after every module the engine must still work (a cascading failure
is never covered by the list).

Run: `python -m pytest tests/conformance/test_modules.py -q` (its summary line is printed at
the end; no pass-rate bar: the xfail list is the contract).
`python tests/conformance/test_modules.py [--draft-xfail] [nn.Name...]` runs modules from the
command line and prints their errors. MODULE_SAMPLES=N changes the samples per module and
training mode (the xfail list is made for the default).
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

if not __package__:  # run as a script (its CLI): the repository root holds `tests`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

import adaptive_eager as ae
from tests.harness.opinfo_bar import MODES, report, summary

pytest.importorskip("expecttest")  # common_modules needs it
from torch.testing._internal.common_modules import module_db  # noqa: E402

from tests.conformance import test_opinfo as fwd  # noqa: E402  the forward test's machinery
from tests.conformance.test_opinfo import (DEVICE, DTYPE, Mismatch, OpResult,  # noqa: E402
                                           _is_tensor, _short, _Timeout, _time_limit, compare,
                                           engine_healthy)
from tests.conformance.test_opinfo_grad import (compare_grads, weighted_loss,  # noqa: E402
                                                weights_for)

XFAIL_FILE = Path(__file__).with_name("modules_xfail.txt")
# samples per module and training mode (runtime budget; the xfail list is made for the default)
SAMPLES_PER_MODULE = int(os.environ.get("MODULE_SAMPLES", "2"))
MAX_SAMPLE_NUMEL = 1 << 14  # skip samples with a bigger tensor (forward and backward)
MODULE_TIMEOUT_S = 120      # per-module guard (SIGALRM, wall clock) against hangs
STEPS = 2                   # training steps per run: the second replays the first
# Modules left out, with the reason (not counted).
SKIP_MODULES = {
}


def module_id(mi) -> str:
    return mi.name


# ------------------------------------------------------------------------------------------
# Samples
# ------------------------------------------------------------------------------------------
def _numel_ok(minput) -> bool:
    leaves, _ = tree_flatten((minput.constructor_input.args, minput.constructor_input.kwargs,
                              minput.forward_input.args, minput.forward_input.kwargs))
    return all(v.numel() <= MAX_SAMPLE_NUMEL for v in leaves if _is_tensor(v))


def trainings(mi) -> tuple:
    return (True, False) if mi.train_and_eval_differ else (True,)


def module_inputs(mi, training: bool):
    """Up to SAMPLES_PER_MODULE usable module inputs spread over the ModuleInfo's list (the
    first always), as (index, input); or a skip reason (str)."""
    if DTYPE not in mi.dtypes:
        return "float32 not in the ModuleInfo's dtypes"
    torch.manual_seed(0)  # the inputs are random tensors
    try:
        inputs = mi.module_inputs_func(mi, device="cpu", dtype=DTYPE, requires_grad=True,
                                       training=training)
    except Exception as exc:  # noqa: BLE001
        return f"module inputs cannot be constructed: {_short(exc)}"
    usable = [(i, m) for i, m in enumerate(inputs)
              if m.forward_input is not None and fwd._strided(
                  (m.forward_input.args, m.forward_input.kwargs)) and _numel_ok(m)]
    if not usable:
        return "no usable module input (none, non-strided or too big)"
    k = min(SAMPLES_PER_MODULE, len(usable))
    return [usable[(j * len(usable)) // k] for j in range(k)]


# ------------------------------------------------------------------------------------------
# One run: build, copy, forward, backward, read back
# ------------------------------------------------------------------------------------------
def _leaves(args, kwargs, device: str, column_major: bool = False):
    """Forward arguments as fresh leaves on `device` (each keeps its requires_grad), and the
    leaves that require grad, in flattening order. `column_major`: floating tensors of 2 or
    more dims with their last two dims' strides swapped (same values)."""
    wrt = []

    def f(t):
        if not _is_tensor(t):
            return t
        v = t.detach().to(device, copy=True)
        if column_major and v.is_floating_point() and v.dim() >= 2 and v.numel():
            v = v.mT.contiguous().mT.detach()
        if t.requires_grad:
            v.requires_grad_(True)
            wrt.append(v)
        return v
    return tree_map(f, tuple(args)), tree_map(f, dict(kwargs)), wrt


def _as_dtype(t):
    return t.to(DTYPE) if _is_tensor(t) and t.is_floating_point() else t


def build(mi, minput, training: bool):
    """The module on CPU, seeded; a lazy module initialized by a dry run on CPU."""
    cin = minput.constructor_input
    # module_db makes some constructor tensors float64 whatever dtype it is asked for
    # (FractionalMaxPool's `_random_samples`, which must have the input's dtype)
    cargs, ckwargs = tree_map(_as_dtype, (tuple(cin.args), dict(cin.kwargs)))
    torch.manual_seed(0)
    m = mi.module_cls(*cargs, **ckwargs)
    m.train(training)
    if isinstance(m, torch.nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():
        args, kwargs, _ = _leaves(minput.forward_input.args, minput.forward_input.kwargs, "cpu")
        with torch.no_grad():
            m(*args, **kwargs)
    return m


def run(mi, minput, training: bool, device: str, column_major: bool = False) -> dict:
    """Build on CPU, move to `device`, then STEPS steps (forward, backward, the loss read)
    and one forward in eval mode under no_grad; every result on CPU."""
    m = build(mi, minput, training)
    if device != "cpu":
        m = m.to(device)
    args, kwargs, wrt = _leaves(minput.forward_input.args, minput.forward_input.kwargs, device,
                                column_major)
    outs, losses = [], []
    for _ in range(STEPS):
        torch.manual_seed(0)
        out = m(*args, **kwargs)
        w = weights_for(out)
        if any(x is not None for x in w):
            loss = weighted_loss(out, w)
            loss.backward()  # gradients accumulate over the steps
            # a sync point ends the step: the next one is replayed (Note [Replay])
            losses.append(loss.item())
        outs.append(out)
    m.eval()  # then inference: running statistics, the transformers' fast path
    with torch.no_grad():
        torch.manual_seed(0)
        outs.append(m(*args, **kwargs))
    devs = [t.device.type for t in tree_flatten(outs)[0] if _is_tensor(t)]
    if any(d != torch.device(device).type for d in devs):
        raise Mismatch(f"outputs on devices {devs}, expected all on {device}")
    names = [n for n, _ in m.named_parameters()]
    return fwd._to_cpu({
        "output": outs,
        "loss": losses,
        "input grads": [v.grad for v in wrt],
        "parameter grads": [p.grad for p in m.parameters()],
        "parameters": list(m.parameters()),
        "buffers": list(m.buffers()),
        "names": names,
    })


def compare_runs(got: dict, expected: dict, *, exact: bool = False) -> None:
    if got["names"] != expected["names"]:
        raise Mismatch(f"parameters {got['names']} != {expected['names']}")
    compare(got["output"], expected["output"], exact=exact)
    compare(got["loss"], expected["loss"], exact=exact, what="loss")
    for what in ("input grads", "parameter grads"):
        try:
            compare_grads(got[what], expected[what], exact=exact)
        except Mismatch as exc:
            raise Mismatch(f"{what}: {exc}") from None
    for what in ("parameters", "buffers"):
        compare(got[what], expected[what], exact=exact, what=what[:-1])


def _run_neuron(mi, minput, training: bool, mode: str, column_major: bool) -> dict:
    if mode == "eager":
        return run(mi, minput, training, DEVICE, column_major)
    with ae.adaptive(strategy="graph" if mode == "adaptive" else "matmul"):
        return run(mi, minput, training, DEVICE, column_major)


def _run_sample(mi, tag: str, minput, training: bool, column_major: bool, res: OpResult,
                modes) -> bool:
    """One module input, every mode. Returns False if CPU cannot run it."""
    try:
        expected = run(mi, minput, training, "cpu", column_major)
    except Exception:  # noqa: BLE001  the module does not run on CPU with this input
        return False
    try:
        compare_runs(run(mi, minput, training, "cpu", column_major), expected, exact=True)
    except Exception as exc:  # noqa: BLE001
        for m in modes:
            res.errors.setdefault(m, f"{tag}: CPU results not reproducible, cannot compare: "
                                     f"{_short(exc)}")
        return True
    eager = None
    for mode in modes:
        if mode in res.errors:
            continue
        try:
            got = _run_neuron(mi, minput, training, mode, column_major)
            compare_runs(got, expected)
            if mode == "eager":
                eager = got
            elif eager is not None:
                try:
                    compare_runs(got, eager, exact=True)
                except Mismatch as exc:
                    raise Mismatch(f"adaptive != eager bit for bit: {exc}") from None
        except _Timeout:
            raise
        except Exception as exc:  # noqa: BLE001
            res.errors[mode] = f"{tag}: {_short(exc)}"
    return True


def _run_module(mi, res: OpResult, modes) -> None:
    if module_id(mi) in SKIP_MODULES:
        res.skipped = SKIP_MODULES[module_id(mi)]
        return
    reasons = []
    for training in trainings(mi):
        samples = module_inputs(mi, training)
        if isinstance(samples, str):
            reasons.append(samples)
            continue
        for j, (i, minput) in enumerate(samples):
            column_major = j % 2 == 1  # every other input in another layout (same values)
            tag = (f"{'train' if training else 'eval'} input {i} ({minput.desc or 'default'}"
                   f"{', column-major' if column_major else ''})")
            res.samples += _run_sample(mi, tag, minput, training, column_major, res, modes)
    if res.samples == 0:
        res.skipped = "; ".join(reasons) or "CPU fails on every module input"
        res.errors.clear()


def run_module(mi, modes=MODES) -> OpResult:
    """One module in every mode, within MODULE_TIMEOUT_S."""
    res = OpResult(module_id(mi))
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with _time_limit(MODULE_TIMEOUT_S):
                _run_module(mi, res, modes)
        except _Timeout as exc:
            for m in modes:
                res.errors.setdefault(m, f"{exc}")
    res.seconds = time.perf_counter() - t0
    return res


# ------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------
XFAIL = fwd.load_xfail(XFAIL_FILE)
MODULES = sorted(module_db, key=module_id)
_ids = [module_id(mi) for mi in MODULES]
assert len(set(_ids)) == len(_ids), "duplicate ModuleInfo names"
_unknown = {name for (_, name) in XFAIL} - set(_ids)
RESULTS: dict[str, OpResult] = {}
_PROCESS_T0 = time.perf_counter()


@pytest.mark.filterwarnings("ignore")
def test_modules_xfail_file_names_exist():
    assert not _unknown, f"{XFAIL_FILE.name} names unknown modules: {sorted(_unknown)}"


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("mi", MODULES, ids=_ids)
def test_module(mi):
    ae.set_strategy("graph")
    res = run_module(mi)
    RESULTS[res.op_id] = res
    fwd.judge(res, XFAIL, XFAIL_FILE.name)


@pytest.fixture(scope="module", autouse=True)
def _summary(request):
    """The pass counts over the modules this file ran, printed after its last test."""
    yield
    if RESULTS:
        report(request, RESULTS, "ModuleInfo", _PROCESS_T0)


# ------------------------------------------------------------------------------------------
# CLI: python tests/conformance/test_modules.py [--draft-xfail] [nn.Name...]
# ------------------------------------------------------------------------------------------
def _main(argv) -> int:
    names = [a for a in argv if not a.startswith("--")]
    ae.set_strategy("graph")
    results = {}
    for mi in MODULES:
        if names and module_id(mi) not in names:
            continue
        t = time.process_time()
        r = run_module(mi)
        results[r.op_id] = r
        h = engine_healthy()
        status = "SKIP " + r.skipped if r.skipped else \
            ("ok" if not r.errors else "; ".join(f"{m}: {e}" for m, e in r.errors.items()))
        print(f"{time.process_time() - t:6.2f}s cpu n={r.samples} {r.op_id}: {status}"
              + (f"  !!HEALTH: {h}" if h else ""), flush=True)
    print(summary(results, "ModuleInfo"))
    if "--draft-xfail" in argv:
        print(f"# draft for {XFAIL_FILE.name}:")
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
