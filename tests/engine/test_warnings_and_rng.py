"""Integer RNG with from/to, and warnings given at the call as often as CPU gives them.
Differential: CPU vs neuron eager vs adaptive, same seed."""
import sys
import warnings

import pytest
import torch

N = "neuron"
I64 = torch.iinfo(torch.int64)


def _bounds(dtype):
    """PyTorch's own test_random_from_to cases (test_tensor_creation_ops.py)."""
    if dtype.is_floating_point:
        lo = int(max(torch.finfo(dtype).min, I64.min))
        hi = int(min(torch.finfo(dtype).max, I64.max))
        return [lo, -42, 0, 42], [-42, 0, 42, hi >> 1]
    if dtype == torch.int64:
        return [I64.min, -42, 0, 42], [-42, 0, 42, I64.max]
    lo, hi = torch.iinfo(dtype).min, torch.iinfo(dtype).max
    return [I64.min, lo - 1, lo, -42, 0, 42, hi, hi + 1], \
        [lo - 1, lo, -42, 0, 42, hi, hi + 1, I64.max]


def _draw(dev, dtype, lo, hi):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            torch.manual_seed(0)
            x = torch.empty(300, dtype=dtype, device=dev)
            x.random_(hi) if lo is None else x.random_(lo, hi)
            res = x.cpu().tolist()  # (exact: no float64 cast on the device)
        except Exception as e:  # noqa: BLE001 (compared with CPU's)
            res = (type(e).__name__, str(e))
    return res, [(x.category, str(x.message), x.lineno) for x in w]


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint32, torch.uint16, torch.int64,
                                   torch.int16, torch.uint8, torch.int8, torch.float32,
                                   torch.float16, torch.bfloat16], ids=str)
def test_random_from_to_is_exact_and_checked_and_warned_as_on_cpu(dtype, mode):
    """Values, bound errors and the precision warnings (once, at the call: they came twice,
    and in adaptive mode at the statement that flushed)."""
    froms, tos = _bounds(dtype)
    for lo in froms + [None]:
        for hi in tos + [None]:
            if lo is None and hi is None:
                continue
            assert _draw(N, dtype, lo, hi) == _draw("cpu", dtype, lo, hi), (lo, hi)


def test_integer_random_above_2_24_is_not_rounded(mode):
    """The issue's int32/uint32 report: random_ is exact; PyTorch's test reads the values
    through `t.to(torch.double)`, which follows the float64 policy (float32 precision)."""
    torch.manual_seed(0)
    a = torch.empty(1000, dtype=torch.int32).random_(2**24, 2**31 - 1)
    torch.manual_seed(0)
    b = torch.empty(1000, dtype=torch.int32, device=N).random_(2**24, 2**31 - 1)
    assert torch.equal(a, b.cpu()) and (a % 2 == 1).any()


def test_a_kernels_warning_comes_at_its_own_statement_in_adaptive_mode(mode):
    x = torch.empty(10, device=N)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        x.random_(0, 2**30)
        y = x + 1
        y.sum().item()
    assert [(str(m.message)[:20], m.lineno) for m in w] == [("to - 1 is out of bou", line)]


def test_a_uint8_mask_is_deprecated_once_per_call_as_on_cpu(mode):
    def run(dev):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            x = torch.arange(6., device=dev)
            m = torch.tensor([1, 0, 1, 0, 1, 1], dtype=torch.uint8, device=dev)
            for _ in range(2):
                r = x[m]
        return r.cpu().tolist(), [str(m.message) for m in w]
    cpu, dev = run("cpu"), run(N)
    assert dev == cpu and len(cpu[1]) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_native_dropout_draws_as_cpu_does_from_the_devices_generator(dtype, mode):
    """`native_dropout` has no overload taking a generator: it swapped the device's state into
    CPU's default generator, so a CPU thread drawing meanwhile took the device's numbers. It
    is composed as CPU's kernel composes it, from the device's generator: CPU's values."""
    x = torch.randn(4, 33, dtype=dtype)
    for p, train in [(0.3, True), (0.0, True), (1.0, True), (0.5, False), (0.5, None)]:
        torch.manual_seed(5)
        want = torch.native_dropout(x, p, train)
        torch.manual_seed(5)
        got = torch.native_dropout(x.to(N), p, train)
        for w, g in zip(want, got):
            assert g.dtype == w.dtype and torch.equal(g.cpu(), w), (p, train)
    torch.manual_seed(5)
    torch.native_dropout(x, 0.3, True)
    cpu_after = torch.rand(3)
    torch.manual_seed(5)
    torch.native_dropout(x.to(N), 0.3, True)
    assert torch.equal(torch.rand(3, device=N).cpu(), cpu_after)  # drew as many as CPU
    with pytest.raises(RuntimeError, match="bernoulli_ expects p to be in"):
        torch.native_dropout(x.to(N), 1.5, True)[0].cpu()


def test_native_dropout_leaves_a_cpu_threads_draws_alone():
    """A CPU thread drawing from the default generator while neuron runs `native_dropout`
    gets the numbers its seed gives (the swap gave it the device's, about once per run)."""
    import threading
    n, seen = 2000, []
    ref = torch.Generator().manual_seed(11)
    want = [torch.rand(8, generator=ref) for _ in range(n)]
    stop = threading.Event()

    def draws():
        for _ in range(n):
            seen.append(torch.rand(8))
        stop.set()

    torch.manual_seed(11)
    t = threading.Thread(target=draws)
    x = torch.randn(64, 64, device=N)
    t.start()
    while not stop.is_set():
        torch.native_dropout(x, 0.5, True)[0].sum().item()
    t.join()
    bad = sum(not torch.equal(a, b) for a, b in zip(seen, want))
    assert bad == 0, f"{bad} of {n} CPU draws were not the CPU generator's"


def test_native_dropout_in_eval_of_a_view_at_an_offset_is_cpus(mode):
    """`native_dropout(x, p, train=False)`'s meta kernel hands back its input, so its output
    looked like a new buffer at the input's offset: the device reserved the bytes up to that
    offset and refused the kernel's smaller result (an AssertionError; fuzzer seeds 43217 and
    45726). A new output's bytes are counted from offset 0, as it is made."""
    base = torch.arange(7.0)
    for f in [lambda t: t.split(1)[-1], lambda t: t[3:], lambda t: t.view(7, 1)[2:5].t()]:
        want = torch.native_dropout(f(base), 0.5, False)
        got = torch.native_dropout(f(base.to(N)), 0.5, False)
        for w, g in zip(want, got):
            assert (g.shape, g.stride(), g.storage_offset(), g.dtype) == (
                w.shape, w.stride(), w.storage_offset(), w.dtype)
            assert torch.equal(g.cpu(), w)
            assert g.untyped_storage().nbytes() == w.untyped_storage().nbytes()
