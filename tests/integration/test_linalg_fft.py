"""Linear algebra and FFTs are device ops (Note [Linear algebra on the device] in fusion/ops.py):
CPU's values, layouts and gradients bit for bit, no CPU fallback, CPU's errors at the call.
Before, every one of them fell back to the CPU ("Operator 'aten::_linalg_eigh' fell back to
CPU"), cutting the fused graph at each call."""
import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

import adaptive_eager as ae

N = "neuron"
L = torch.linalg


def _real(z):
    return torch.view_as_real(z.resolve_conj())


def _spd(a):
    return a @ a.mT + a.shape[-1] * torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)


# name -> (input shapes and dtype, function of the inputs returning a tensor or a tuple).
# Batched inputs throughout; the gradients flow to every input that is floating point.
_CASES = {
    "inv, det, slogdet": (((2, 3, 4, 4),), torch.float32, lambda a: (
        L.inv(a), L.det(a), *L.slogdet(a), L.inv_ex(a).inverse)),
    "solve, lu_factor, lu_solve, lu": (((3, 4, 4), (3, 4, 2)), torch.float32, lambda a, b: (
        L.solve(a, b), L.solve(a.mT, b), L.solve(a, b.mT, left=False),
        *L.lu_factor(a), L.lu_solve(*L.lu_factor(a), b), *L.lu(a))),
    "cholesky, cholesky_solve, cholesky_inverse": (((2, 4, 4), (2, 4, 3)), torch.float32,
                                                   lambda a, b: (
        L.cholesky(_spd(a)), L.cholesky(_spd(a), upper=True),
        torch.cholesky_solve(b, L.cholesky(_spd(a))), torch.cholesky_inverse(L.cholesky(_spd(a))))),
    "eigh, eigvalsh, svd, svdvals, pinv": (((2, 5, 5),), torch.float32, lambda a: (
        *L.eigh(_spd(a)), L.eigvalsh(_spd(a)), L.svd(a, full_matrices=False)[1],
        L.svdvals(a), L.pinv(a), L.matrix_norm(a, 2), L.cond(a))),
    "qr, householder_product, triangular solves, matrix_exp": (((2, 5, 3), (2, 3, 3)),
                                                                torch.float32, lambda a, b: (
        *L.qr(a), L.householder_product(*torch.geqrf(a.detach())),
        L.solve_triangular(b.triu() + 3 * torch.eye(3, device=b.device), a.mT, upper=True),
        torch.triangular_solve(a.mT, b.tril() + 3 * torch.eye(3, device=b.device), upper=False)[0],
        L.matrix_exp(b / 4), L.matrix_power(b + 3 * torch.eye(3, device=b.device), -2))),
    "eig, eigvals (complex results)": (((2, 4, 4),), torch.float32, lambda a: (
        _real(L.eigvals(a)).abs(),)),
    "ldl": (((4, 4), (4, 2)), torch.float32, lambda a, b: (
        *L.ldl_factor(_spd(a.detach())), L.ldl_solve(*L.ldl_factor(_spd(a.detach())), b.detach()),
        b * 1)),  # (ldl has no derivatives)
    "complex inv, solve, qr, eigh": (((2, 3, 3), (2, 3, 2)), torch.complex64, lambda a, b: (
        L.inv(a), L.solve(a, b), *L.qr(a), L.eigvalsh(_spd(a)), L.det(a))),
    "rfft, irfft, fft2, ifft, hfft, ihfft": (((3, 8, 6),), torch.float32, lambda x: (
        _real(torch.fft.rfft(x)), torch.fft.irfft(torch.fft.rfft(x, dim=1), dim=1),
        _real(torch.fft.fft2(x)), _real(torch.fft.ifft(x, norm="ortho")),
        torch.fft.hfft(x[..., :4].to(torch.complex64)), _real(torch.fft.ihfft(x)),
        _real(torch.fft.rfftn(x, dim=(0, 1))),
        torch.fft.irfftn(torch.fft.rfftn(x, dim=(0, 2)), x.shape[::2], dim=(0, 2)))),
    "complex fft, fftn, ifftn, stft": (((4, 8), (64,)), torch.complex64, lambda z, w: (
        _real(torch.fft.fft(z, n=12)), _real(torch.fft.fftn(z.mT)),
        _real(torch.fft.ifftn(z, dim=0)), _real(torch.stft(
            w.real, 16, window=torch.hann_window(16, device=w.device), return_complex=True)))),
}


def _run(name, d):
    """`_CASES[name]`'s outputs and its inputs' gradients on device `d`."""
    shapes, dtype, fn = _CASES[name]
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(s, generator=g, dtype=dtype).to(d).requires_grad_() for s in shapes]
    outs = fn(*xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum(_real(o).sum() if o.is_complex() else o.float().sum()
               for o in outs if o.requires_grad)
    grads = torch.autograd.grad(loss, xs, allow_unused=True) if torch.is_tensor(loss) else ()
    return [o.detach().cpu() for o in outs] + [x.cpu() for x in grads if x is not None], \
        [(o.shape, o.stride()) for o in outs]


@pytest.mark.parametrize("name", list(_CASES))
def test_linalg_and_fft_on_the_device_as_cpu(mode, name):
    with _disable_current_modes():
        ref, ref_layouts = _run(name, "cpu")
    ae.reset_metrics()
    got, layouts = _run(name, N)
    assert ae.metrics().cpu_fallbacks == {}
    assert layouts == ref_layouts  # CPU's layouts: LAPACK's column-major, MKL's FFT order
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == b.dtype and torch.equal(a, b), (name, i, (a - b).abs().max())


def test_linalg_is_queued_and_fused_in_adaptive_mode():
    """Ops without an error check queue and fuse as contractions (pointwise epilogues,
    prologues); a check (`linalg.inv`'s `_linalg_check_errors`) is a sync, as on CUDA."""
    a = torch.randn(4, 4).to(N)
    x = torch.randn(16, 32).to(N)
    with ae.adaptive():
        torch.neuron.synchronize()
        before = ae.metrics()
        y = L.inv_ex(a * 2).inverse.exp() + L.det(a)
        z = torch.fft.irfft(torch.fft.rfft(x) * 0.5, n=32).relu()
        m = ae.metrics() - before
        assert m.flushes == {} and m.launches == 0  # nothing ran yet: all queued
        y, z = y.cpu(), z.cpu()
        m = ae.metrics() - before
        assert m.launches < m.ops - 4  # fused: fewer launches than ops
        before = ae.metrics()
        L.inv(a)
        assert (ae.metrics() - before).flushes == {
            "data-dependent:aten::_linalg_check_errors": 1}
    with _disable_current_modes():
        ac, xc = a.cpu(), x.cpu()
        assert torch.equal(y, L.inv_ex(ac * 2).inverse.exp() + L.det(ac))
        assert torch.equal(z, torch.fft.irfft(torch.fft.rfft(xc) * 0.5, n=32).relu())


def _error(fn, *xs):
    try:
        fn(*xs)
    except Exception as e:
        return type(e), str(e)
    return None


_SINGULAR = {  # name -> (function, its input): each raises on CPU
    "inv": (L.inv, torch.zeros(2, 3, 3)),
    "inv_ex checked": (lambda a: L.inv_ex(a, check_errors=True), torch.ones(3, 3)),
    "solve": (lambda a: L.solve(a, a[:, :1]), torch.ones(3, 3)),
    "cholesky": (L.cholesky, -torch.eye(3)),
    "cholesky_ex checked": (lambda a: L.cholesky_ex(a, check_errors=True), -torch.eye(3)),
    "lu_factor": (L.lu_factor, torch.zeros(3, 3)),
    "cholesky_inverse": (torch.cholesky_inverse, torch.zeros(3, 3)),
    "eigh of nan": (L.eigh, torch.full((3, 3), float("nan"))),
    "svd of nan": (L.svdvals, torch.full((3, 3), float("nan"))),
    "eig of nan": (L.eig, torch.full((3, 3), float("nan"))),
    "matrix_power -1": (lambda a: L.matrix_power(a, -1), torch.zeros(3, 3)),
}


@pytest.mark.parametrize("name", list(_SINGULAR))
def test_singular_matrix_raises_cpus_error_at_the_call(mode, name):
    """CPU raises `torch.linalg.LinAlgError` (or its RuntimeError) at the call, and code
    catches it there (a Cholesky retried with jitter): so does the device, in eager and
    adaptive mode, and the work queued before the call is unharmed."""
    fn, a = _SINGULAR[name]
    with _disable_current_modes():
        want = _error(fn, a)
    assert want is not None
    before = torch.arange(3.0).to(N) * 2  # queued in adaptive mode
    got = _error(fn, a.to(N))
    assert got == want
    assert torch.equal(before.cpu(), torch.arange(3.0) * 2)
    assert ae.metrics().cpu_fallbacks == {}


def test_cholesky_with_jitter_retry_as_cpu(mode):
    """The pattern a LinAlgError at the call serves: retry with a larger diagonal."""
    def chol(a):
        for jitter in (0.0, 1e-3, 1e-1, 1.0):
            try:
                return L.cholesky(a + jitter * torch.eye(3, device=a.device)), jitter
            except torch.linalg.LinAlgError:
                continue
    a = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    with _disable_current_modes():
        want, wj = chol(a)
    got, gj = chol(a.to(N))
    assert gj == wj and torch.equal(got.cpu(), want)


def test_an_fft_too_big_to_probe_keeps_cpus_layout(mode):
    """MKL's FFT orders an output's dims by the input's strides, which the meta kernel does
    not (rfft2 over dims (0, 1) of a (64, 512, 130) tensor: (257, 1, 16448) on CPU,
    (1, 64, 16448) in meta). Above the probe's bound (16 MiB) the op takes CPU's fake kernel's
    layout (Note [Layouts of unprobed signatures] in engine/meta.py)."""
    x = torch.randn(64, 512, 130)
    with _disable_current_modes():
        want = torch.fft.rfft2(x, dim=(0, 1))
    ae.reset_metrics()
    got = torch.fft.rfft2(x.to(N), dim=(0, 1))
    assert got.stride() == want.stride() == (257, 1, 16448)
    assert torch.equal(got.cpu(), want) and ae.metrics().cpu_fallbacks == {}
