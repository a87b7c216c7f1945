"""The native hooks (Note [Native hooks] in adaptive_eager/integration/native.py): what
PyTorch asks only of a C++ backend. Each test closes a known gap the Python hooks left; the last ones
force the fallback (ADAPTIVE_EAGER_NATIVE=0, no compiler) in a subprocess."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.integration import native

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_native = pytest.mark.skipif(not ae.native_hooks(), reason="the native hooks are off")


def test_native_hooks_are_built_where_a_compiler_is():
    """CI has g++: there the hooks must load (else every test below silently skips)."""
    if not ae.config.native:
        pytest.skip("ADAPTIVE_EAGER_NATIVE=0")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    assert ae.native_hooks(), native.why_not()
    assert native.module().installed()


# -- pinned memory ---------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("factory", [
    lambda: torch.empty(3, 4, pin_memory=True),
    lambda: torch.zeros(5, pin_memory=True),
    lambda: torch.ones(2, 2, dtype=torch.float16, pin_memory=True),
    lambda: torch.full((3,), 7.0, pin_memory=True),
    lambda: torch.randn(4, pin_memory=True),
    lambda: torch.empty_strided((2, 3), (1, 2), pin_memory=True),
    lambda: torch.tensor([1.0, 2.0], pin_memory=True),
    lambda: torch.empty(0, pin_memory=True),
], ids=["empty", "zeros", "ones", "full", "randn", "empty_strided", "tensor", "empty0"])
def test_factories_with_pin_memory(factory):
    t = factory()
    assert t.device.type == "cpu" and t.is_pinned()
    if t.numel() > 1:
        assert t[1:].is_pinned()  # a view of pinned memory is pinned
    assert not torch.empty_like(t).is_pinned()
    # empty() holds whatever bytes were there, NaN included: the round trip must keep them all
    torch.testing.assert_close(t.to("neuron", non_blocking=True).cpu(), t, rtol=0, atol=0, equal_nan=True)


@needs_native
def test_pinned_memory_is_forgotten_when_freed():
    t = torch.empty(1000, pin_memory=True)
    ptr = t.data_ptr()
    assert native.module().is_pinned_ptr(ptr) and native.module().is_pinned_ptr(ptr + 3999)
    del t
    assert not native.module().is_pinned_ptr(ptr) or torch.empty(1000, pin_memory=True)


@needs_native
def test_pin_memory_of_a_tensor_uses_the_allocator():
    x = torch.randn(3, 4)
    p = x.pin_memory()
    assert p.is_pinned() and not x.is_pinned() and torch.equal(p, x)
    assert native.module().is_pinned_ptr(p.data_ptr())


# -- generators ------------------------------------------------------------------------
def _draws(device, gen):
    """Every kind of random op, given `gen`."""
    p = torch.full((6,), 0.5, device=device)
    w = torch.tensor([0.1, 0.2, 0.7], device=device)
    return [torch.randn(4, device=device, generator=gen),
            torch.rand(2, 3, device=device, generator=gen),
            torch.randint(0, 10, (5,), device=device, generator=gen),
            torch.empty(4, device=device).normal_(2.0, 3.0, generator=gen),
            torch.empty(4, device=device).uniform_(-1, 1, generator=gen),
            torch.bernoulli(p, generator=gen),
            torch.multinomial(w, 4, replacement=True, generator=gen),
            torch.randperm(7, device=device, generator=gen),
            torch.empty(3, device=device).exponential_(generator=gen)]


@needs_native
def test_generator_draws_equal_cpu_and_repeat_with_manual_seed(mode):
    g = torch.Generator(device="neuron")
    assert g.device == torch.device("neuron", 0)
    g.manual_seed(123)
    first = [t.cpu() for t in _draws("neuron", g)]
    g.manual_seed(123)
    again = [t.cpu() for t in _draws("neuron", g)]
    cpu = _draws("cpu", torch.Generator().manual_seed(123))
    for a, b, c in zip(first, again, cpu):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert g.initial_seed() == 123


@needs_native
def test_generator_state_and_its_order_in_adaptive_mode():
    """Draws given a generator are taken at the call: reseeding afterwards in adaptive mode
    (ops still queued) leaves them as drawn."""
    g = torch.Generator(device="neuron").manual_seed(1)
    state = g.get_state()
    with ae.adaptive():
        a = torch.randn(5, device="neuron", generator=g) * 2
        g.manual_seed(99)  # before the queued multiply ran
        g.set_state(state)
        b = torch.randn(5, device="neuron", generator=g) * 2
        assert torch.equal(a.cpu(), b.cpu())
    c = torch.Generator(device="neuron")
    c.set_state(state)
    assert torch.equal(torch.randn(5, device="neuron", generator=c).cpu() * 2, a.cpu())
    # A generator does not touch the core's default generator
    torch.manual_seed(3)
    before = torch.neuron.get_rng_state()
    torch.rand(4, device="neuron", generator=g)
    assert torch.equal(torch.neuron.get_rng_state(), before)


@needs_native
def test_default_generator_is_the_device_rng(mode):
    """torch.neuron.default_generators[k]: its state is get_rng_state(k); seeding it seeds the
    core's draws (queued ones first run under the old state)."""
    g = torch.neuron.default_generators[0]
    assert g.device == torch.device("neuron", 0)
    torch.manual_seed(11)
    assert g.initial_seed() == 11
    assert torch.equal(g.get_state(), torch.neuron.get_rng_state(0))
    queued = torch.rand(3, device="neuron")
    g.manual_seed(5)
    drawn = torch.rand(3, device="neuron")
    torch.manual_seed(11)
    assert torch.equal(queued.cpu(), torch.rand(3))
    torch.manual_seed(5)
    assert torch.equal(drawn.cpu(), torch.rand(3))
    g.set_state(torch.neuron.get_rng_state(0))  # set through one, read through the other
    s = torch.neuron.get_rng_state(0)
    torch.neuron.set_rng_state(torch.Generator().manual_seed(8).get_state())
    assert g.initial_seed() == 8 and not torch.equal(g.get_state(), s)


@needs_native
def test_generator_of_another_core_and_devices():
    g = torch.Generator(device="neuron:1").manual_seed(4)
    assert g.device == torch.device("neuron", 1)
    x = torch.randn(3, device="neuron:1", generator=g)
    assert x.device == torch.device("neuron", 1)
    assert torch.equal(x.cpu(), torch.randn(3, generator=torch.Generator().manual_seed(4)))
    with pytest.raises(RuntimeError, match="Expected a 'neuron' device type for generator but "
                                           "found 'cpu'"):
        torch.randn(3, device="neuron", generator=torch.Generator())
    with pytest.raises(RuntimeError, match="neuron:9 does not exist"):
        torch.Generator(device="neuron:9")


@needs_native
def test_generator_in_a_sampler_and_dataloader():
    """Samplers take a generator; a neuron one draws as the CPU one."""
    from torch.utils.data import RandomSampler
    a = list(RandomSampler(range(10), generator=torch.Generator().manual_seed(2)))
    g = torch.Generator(device="neuron").manual_seed(2)
    b = [int(i) for i in torch.randperm(10, generator=g, device="neuron").cpu()]
    assert a == b


# -- the current core ------------------------------------------------------------------
@pytest.fixture
def core0():
    yield
    torch.neuron.set_device(0)


def _landing():
    """Where each index-less way of making a neuron tensor lands."""
    m = torch.nn.Linear(2, 2).to("neuron")
    return {"to": torch.ones(2).to("neuron").device,
            "tensor": torch.tensor([1.0], device="neuron").device,
            "as_tensor": torch.as_tensor([1.0], device="neuron").device,
            "module": m.weight.device,
            "empty": torch.empty(2, device="neuron").device,
            "neuron()": torch.ones(1).neuron().device}


@needs_native
def test_set_device_moves_index_less_neuron(core0):
    torch.neuron.set_device(1)
    assert torch.neuron.current_device() == 1
    assert set(_landing().values()) == {torch.device("neuron", 1)}
    x = torch.ones(3).to("neuron")
    torch.testing.assert_close((x * 2 + 1).cpu(), torch.full((3,), 3.0))
    with torch.neuron.device(2):
        assert set(_landing().values()) == {torch.device("neuron", 2)}
    assert torch.neuron.current_device() == 1
    assert torch.accelerator.current_device_index() == 1


@needs_native
def test_current_core_is_per_thread(core0):
    torch.neuron.set_device(1)
    seen = {}

    def other():
        seen["start"] = torch.neuron.current_device()  # a new thread starts on core 0 (CUDA)
        torch.neuron.set_device(2)
        seen["landing"] = set(_landing().values())
        seen["value"] = (torch.ones(2).to("neuron") + 1).cpu()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["start"] == 0 and seen["landing"] == {torch.device("neuron", 2)}
    assert torch.equal(seen["value"], torch.full((2,), 2.0))
    assert torch.neuron.current_device() == 1  # the main thread's is its own
    assert set(_landing().values()) == {torch.device("neuron", 1)}


@needs_native
def test_streams_reach_the_device_guard():
    s = torch.neuron.Stream()
    mod = native.module()
    assert mod.current_stream(0) == 0
    with torch.neuron.stream(s):
        assert mod.current_stream(0) == s.stream_id != 0
        assert torch.Stream(device="neuron").stream_id != s.stream_id  # ids from one counter
    assert mod.current_stream(0) == 0
    torch.Stream(device="neuron").synchronize()  # PyTorch's generic streams sync the core


# -- the fallback: the package works without the hooks ----------------------------------
_WITHOUT = r"""
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch  # (its entry point imports adaptive_eager)
    import adaptive_eager as ae
for w in caught:
    print("WARNING", w.message)
assert not ae.native_hooks()
x = torch.randn(4, 4).to("neuron")
torch.testing.assert_close((x @ x + 1).cpu(), x.cpu() @ x.cpu() + 1)
from fusion import host                    # Note [Host calls]: the Python guard
assert host.host_call is host._python_host_call
y, c = x, x.cpu()
for _ in range(4):                         # eager ops launched from their traces
    y, c = (y * 1.5 + 1).mH, (c * 1.5 + 1).mH
assert torch.equal(y.cpu(), c) and ae.metrics().replayed_ops > 0
p = torch.randn(3).pin_memory()            # the Python path
assert p.is_pinned()
torch.manual_seed(0); a = torch.rand(3, device="neuron").cpu()
torch.manual_seed(0); assert torch.equal(a, torch.rand(3))
try:
    torch.Generator(device="neuron")
except RuntimeError:
    pass
else:
    raise AssertionError("a neuron generator without the hooks")
torch.neuron.set_device(1)
assert torch.neuron.current_device() == 1
from adaptive_eager.integration import native
print("OK", native.why_not())
"""


def _run_without(env):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **env)
    out = subprocess.run([sys.executable, "-c", _WITHOUT], env=env, capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


def test_forced_off_works_without_warning():
    assert _run_without({"ADAPTIVE_EAGER_NATIVE": "0"}) == ["OK ADAPTIVE_EAGER_NATIVE=0"]


def test_no_compiler_works_with_one_warning(tmp_path):
    """No compiler and nothing built yet (a fresh cache): the package works as without the
    hooks, with one warning that names what is missing."""
    out = _run_without({"XDG_CACHE_HOME": str(tmp_path), "CXX": "no-such-compiler-xyz",
                        "ADAPTIVE_EAGER_NATIVE": "1"})  # (also when the suite runs with 0)
    why = "the native hooks could not be built or loaded: no C++ compiler ('no-such-compiler-xyz'"
    assert len(out) == 2 and out[0].startswith(f"WARNING adaptive_eager: {why}"), out
    assert out[1].startswith(f"OK {why}"), out


def test_the_build_finds_ninja_or_names_it(tmp_path, monkeypatch):
    """torch's build runs `ninja` from PATH. The `ninja` package's, beside an unactivated
    venv's python, is put first for the build; with none anywhere the error names ninja
    (the warning above then carries it)."""
    if shutil.which("ninja") is not None:  # on PATH: used as it is
        assert native._with_ninja(os.environ["PATH"]) == os.environ["PATH"]
    empty = str(tmp_path)  # a PATH with no ninja on it
    pkg = tmp_path / "pkg"
    (pkg / "bin").mkdir(parents=True)
    (pkg / "bin" / "ninja").write_text("#!/bin/sh\n")
    (pkg / "bin" / "ninja").chmod(0o755)
    fake = type(sys)("ninja")
    fake.BIN_DIR = str(pkg / "bin")
    monkeypatch.setitem(sys.modules, "ninja", fake)
    assert native._with_ninja(empty) == str(pkg / "bin") + os.pathsep + empty
    monkeypatch.setitem(sys.modules, "ninja", None)  # not installed
    with pytest.raises(RuntimeError, match=r"no ninja, which torch's C\+\+ build needs"):
        native._with_ninja(empty)


# -- host calls ----------------------------------------------------------------------------
@needs_native
def test_host_call_runs_under_host_kernels_keys_in_one_call():
    """Note [Host calls] in fusion/host.py: the flush's host kernels run through the native
    `host_call`, under exactly the dispatch keys `host_kernels()` sets: outside any dispatch,
    inside a __torch_dispatch__ (Conjugate excluded: the view keys back on, the Python keys
    off) and under a dispatch mode; the thread's keys are restored on return and when the
    call raises (the very exception goes through)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from fusion import host
    hc = native.module().host_call
    assert host.host_call is hc

    def keys():
        return (torch._C._dispatch_tls_local_include_set().raw_repr(),
                torch._C._dispatch_tls_local_exclude_set().raw_repr())

    seen = []

    def probe():
        before = keys()
        with host.host_kernels():
            want = keys()
        assert hc(keys) == want != before and keys() == before
        assert hc(lambda a, b=0: (a, b), 1, 2) == (1, 2)
        err = ValueError("from the kernel")

        def boom():
            raise err
        with pytest.raises(ValueError) as e:
            hc(boom)
        assert e.value is err and keys() == before
        seen.append(before)

    class Probe(torch.Tensor):
        @staticmethod
        def __new__(cls):
            return torch.Tensor._make_wrapper_subclass(cls, (1,))

        __torch_function__ = torch._C._disabled_torch_function_impl

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            probe()
            return torch.zeros(1)

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            probe()
            return func(*args, **(kwargs or {}))

    probe()
    outside = seen[0]
    Probe() + 1
    assert len(seen) >= 2 and seen[-1] != outside  # inside dispatch: other keys
    n = len(seen)
    with Mode():
        torch.ones(1) + 1
    assert len(seen) > n
    with pytest.raises(TypeError, match="needs a function"):
        hc()
