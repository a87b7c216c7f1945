"""out= tensors that are views (offset, narrowed, transposed, strided) or of the wrong shape:
written where CPU writes, resized as CPU resizes them (or kept), warned about as often as
CPU warns. Differential: CPU vs neuron eager vs adaptive, same program."""
import warnings

import pytest
import torch

import adaptive_eager as ae

N = "neuron"


def _x(dev):
    return torch.arange(4., device=dev).reshape(2, 2) + 1


OPS = {
    "arange": lambda d, o: torch.arange(0, 4, out=o),
    "arange_step": lambda d, o: torch.arange(0., 2., .5, out=o),
    "linspace": lambda d, o: torch.linspace(0, 4, 4, out=o),
    "logspace": lambda d, o: torch.logspace(0, 2, 4, out=o),
    "logspace_base2": lambda d, o: torch.logspace(0, 2, 4, base=2, out=o),
    "range": lambda d, o: torch.range(0, 3, out=o),
    "randperm": lambda d, o: torch.randperm(4, out=o),
    "eye": lambda d, o: torch.eye(2, out=o),
    "eye_grows": lambda d, o: torch.eye(3, out=o),  # past the view's buffer (fuzzer seed 0)
    "full": lambda d, o: torch.full((2, 2), 3., out=o),
    "zeros": lambda d, o: torch.zeros((2, 2), out=o),
    "ones": lambda d, o: torch.ones(4, out=o),
    "cat": lambda d, o: torch.cat([_x(d)[:1], _x(d)[1:]], out=o),
    "add": lambda d, o: torch.add(_x(d), 1, out=o),
    "sum": lambda d, o: torch.sum(_x(d), 0, out=o),
    "take": lambda d, o: torch.take(_x(d), torch.tensor([3, 2, 1, 0], device=d), out=o),
    "randint": lambda d, o: torch.randint(0, 5, (2, 2), out=o),
    "normal": lambda d, o: torch.normal(0., 1., (2, 2), out=o),
    # Note [matrix_rank's out=]: PyTorch's kernel left `o` unwritten for a tensor subclass
    "matrix_rank": lambda d, o: torch.linalg.matrix_rank(_x(d).expand(2, 2, 2), out=o),
    "matrix_rank_atol": lambda d, o: torch.linalg.matrix_rank(_x(d), atol=0.5, out=o),
    "log_softmax": lambda d, o: torch.log_softmax(_x(d), 1, dtype=o.dtype, out=o),  # (these
    "softmax": lambda d, o: torch.softmax(_x(d), 0, dtype=o.dtype, out=o),  # fell back)
}


def _layouts(dev, dtype):
    def z(*s):
        return torch.zeros(*s, device=dev, dtype=dtype)
    b1, b2, b3, b4, b5, b6 = z(2, 3), z(3, 3), z(2, 4), z(6), z(2, 3), z(3, 4)
    return [(z(2, 2), None), (b1.narrow(1, 1, 2), b1), (b2.t()[1:3, :2], b2),
            (b3[:, ::2], b3), (b4[1:5], b4), (b5[:, :1], b5), (z(0), None),
            (b6[1:, 1:3], b6)]


def _run(dev, op, dtype):
    """Per layout: (shape, stride, offset, values, the base's values) or the error, and the
    warnings given (category and text, in order)."""
    got = []
    for i in range(len(_layouts("cpu", dtype))):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                torch.manual_seed(0)
                o, base = _layouts(dev, dtype)[i]
                OPS[op](dev, o)
                res = (tuple(o.shape), o.stride(), o.storage_offset(), o.cpu().tolist(),
                       None if base is None else base.cpu().tolist())
            except Exception as e:  # noqa: BLE001 (compared with CPU's)
                res = (type(e).__name__, str(e))
        got.append((res, [(x.category, str(x.message)) for x in w
                          if "fell back" not in str(x.message)
                          and "float64 is not" not in str(x.message)]))
    return got


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_out_views_are_written_resized_and_warned_as_on_cpu(op, dtype, mode):
    if op in ("log_softmax", "softmax") and dtype == torch.int64:
        pytest.skip("no integer softmax: CPU resizes the out= and raises, neuron just raises")
    cpu, dev = _run("cpu", op, dtype), _run(N, op, dtype)
    for i, (c, n) in enumerate(zip(cpu, dev)):
        assert n == c, f"layout {i}"


def test_arange_into_a_narrowed_row_pair_is_the_issues_repro(mode):
    for dev in ("cpu", N):
        x = torch.zeros(2, 3, device=dev)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.arange(0, 4, out=x.narrow(1, 1, 2))
        assert x.tolist() == [[0, 0, 1], [0, 2, 3]]


def test_a_resize_warning_is_given_once_per_call_as_on_cpu(mode):
    """CPU's resize warning came twice on the device: once from our resize, once from the
    meta kernel's C++ warning, which waited for the end of the user's call (Note [C++
    warnings]); and again on every later call of the same signature only once."""
    for _ in range(3):
        out = torch.zeros(2, 2, device=N)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.sum(torch.ones(2, 2, device=N), 0, out=out)
        assert [str(x.message)[:30] for x in w] == ["An output with one or more ele"]
        assert out.tolist() == [2., 2.]


def test_matrix_rank_into_out_with_cpu_tensors_inside_the_scope():
    """Under a dispatch mode PyTorch's kernel left a CPU `out=` unwritten too (Note
    [matrix_rank's out=])."""
    a = torch.tensor([[1., 2.], [2., 4.]]).expand(3, 2, 2)
    out = torch.full((3,), 7)
    with ae.adaptive():
        r = torch.linalg.matrix_rank(a, out=out)
    assert r is out and out.tolist() == [1, 1, 1]


@pytest.mark.parametrize("op", ["log_softmax", "softmax", "eigvals", "int_mm", "scaled_mm"])
def test_out_forms_and_quantized_matmuls_run_on_the_device(op, mode):
    """Ops that fell back to the CPU (no class for the device): softmax's `out=` with a
    dtype, `linalg.eigvals`'s `out=`, the int8 and float8 matmuls; fallbacks refused here."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 4, generator=g)
    q = torch.randint(-9, 9, (32, 32), generator=g).to(torch.int8)
    f8, s = torch.randn(16, 32, generator=g).to(torch.float8_e4m3fn), torch.tensor(1.5)
    calls = {
        "log_softmax": lambda d: torch.log_softmax(a.to(d), 1, dtype=torch.float32,
                                                   out=torch.empty(4, 4, device=d)),
        "softmax": lambda d: torch.softmax(a.to(d), 0, dtype=torch.float32,
                                           out=torch.empty(4, 4, device=d)),
        "eigvals": lambda d: torch.linalg.eigvals(a.to(d), out=torch.empty(
            4, dtype=torch.complex64, device=d)),
        "int_mm": lambda d: torch._int_mm(q.to(d), q.t().to(d)),
        "scaled_mm": lambda d: torch._scaled_mm(
            f8.to(d), f8.t().to(d), s.to(d), s.to(d), out_dtype=torch.float32),
    }
    with ae.override(fallback_enabled=False):
        got = calls[op](N)
    assert torch.equal(got.cpu(), calls[op]("cpu"))


@pytest.mark.parametrize("op", ["sum", "cumsum", "mean", "softmax"])
def test_float64_out_with_a_float64_dtype_computes(op, mode):
    """A float64 out= runs as float32 (Note [float64 policy]), and so must the float64 dtype
    asked for it: the kernel refused its float32 twin ("Expected out tensor to have dtype
    double") at the sync, where CPU computes."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    fns = {"sum": lambda d, o: torch.sum(x.to(d), 0, dtype=torch.float64, out=o),
           "cumsum": lambda d, o: torch.cumsum(x.to(d), 0, dtype=torch.float64, out=o),
           "mean": lambda d, o: torch.mean(x.to(d), 0, dtype=torch.float64, out=o),
           "softmax": lambda d, o: torch.softmax(x.to(d), 0, dtype=torch.float64, out=o)}
    shape = (4,) if op in ("sum", "mean") else (3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (float64 on neuron)
        outs = {d: torch.zeros(shape, dtype=torch.float64, device=d) for d in ("cpu", N)}
        for d, o in outs.items():
            fns[op](d, o)
    torch.testing.assert_close(outs[N].cpu(), outs["cpu"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("op", ["unbind_copy", "split_with_sizes_copy", "split_copy"])
def test_out_lists_an_op_does_not_return_are_resized_as_on_cpu(op, mode):
    """An op returning nothing (`-> ()`) that writes a list of out= tensors: the device left
    them as they were (empty, or of the old shape, unwritten) where CPU resizes and fills
    them; in adaptive mode the flush then failed."""
    x = torch.arange(12.).reshape(3, 4)
    fns = {"unbind_copy": lambda t, o: torch.unbind_copy(t, 0, out=o),
           "split_with_sizes_copy": lambda t, o: torch.split_with_sizes_copy(t, [1, 3], 1,
                                                                              out=o),
           "split_copy": lambda t, o: torch.split_copy(t, 2, 1, out=o)}
    got = {}
    for d in ("cpu", N):
        outs = [torch.empty(0, device=d), torch.zeros(2, device=d), torch.zeros(3, 3, device=d)]
        outs = outs[:2] if op != "unbind_copy" else outs
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                fns[op](x.to(d), outs)
                err = None
            except RuntimeError as e:  # (split_copy copies without resizing: CPU raises)
                err = str(e)
        got[d] = ([(tuple(o.shape), o.stride(), o.cpu().tolist()) for o in outs], err,
                  [str(m.message)[:120] for m in w if "fell back" not in str(m.message)])
    assert got[N] == got["cpu"]


def test_an_in_place_op_that_cpu_resizes_resizes_self(mode):
    """`addbmm_` of a (1,) self: CPU's kernel resizes self to the result's shape (deprecated,
    no warning); the device kept it (1,), holding one element of the sum: a wrong value."""
    b1, b2 = torch.ones(3, 5, 4), torch.arange(120.).reshape(3, 4, 10)
    got = {}
    for d in ("cpu", N):
        s = torch.ones(1, device=d)
        r = s.addbmm_(b1.to(d), b2.to(d))
        assert r is s
        got[d] = (tuple(s.shape), s.stride(), s.cpu().tolist())
    assert got[N] == got["cpu"]
