"""Row assignment loops (`a[i] = row`, `a[i] = src[i]`: PyTorch's reference loop for
index_copy) and copies between views: the values CPU gives, in eager and adaptive mode, for
rows at every offset, non-contiguous rows, broadcast rows, rows of another dtype, negative
indices, copies within one buffer, and CPU's errors at the call (Note [Direct copies],
Note [View inference]). Then the counts that make the loop proportionate: no executable is
compiled per row, one launch per assignment in eager mode."""
import pytest
import torch

import adaptive_eager as ae

N = "neuron"


def _g():
    return torch.Generator().manual_seed(0)


def _programs():
    """name -> program(dev) returning the tensors to compare (each a fresh run)."""
    def rows_device(dev):
        a = torch.zeros(7, 5, device=dev)
        rows = torch.randn(7, 5, generator=_g()).to(dev)
        for i in range(7):
            a[i] = rows[6 - i] * (i + 1)  # (a computed row: queued in adaptive mode)
        return a

    def rows_host(dev):
        a = torch.zeros(6, 4, device=dev)
        for i in range(6):
            a[i] = torch.full((4,), float(i)) - torch.arange(4.)  # host rows
        return a

    def negative(dev):
        a = torch.zeros(6, 3, device=dev)
        src = torch.randn(6, 3, generator=_g()).to(dev)
        for i in range(1, 7):
            a[-i] = src[i - 1]
        return a

    def offset_base(dev):  # `a` is itself a view at an offset into a bigger buffer
        big = torch.zeros(9, 8, device=dev)
        a = big[2:, 3:]
        src = torch.randn(7, 5, generator=_g()).to(dev)
        for i in range(7):
            a[i] = src[(3 * i) % 7]
        return big

    def non_contiguous(dev):  # rows of a transposed source (stride 7) into column views
        src = torch.randn(5, 7, generator=_g()).to(dev).t()
        a = torch.zeros(5, 7, device=dev)
        for i in range(7):
            a[:, i] = src[i]
        return a

    def broadcast(dev):
        a = torch.zeros(4, 3, 2, device=dev)
        col = torch.randn(3, 1, generator=_g()).to(dev)
        one = torch.tensor([2.5]).to(dev)
        for i in range(4):
            a[i] = col if i % 2 else one  # (3, 1) and (1,) broadcast to (3, 2)
        a[1, 2] = torch.tensor(7.).to(dev)  # a 0-d device tensor
        return a

    def dtypes(dev):
        f = torch.zeros(4, 3, device=dev)
        n = torch.zeros(4, 3, dtype=torch.int32, device=dev)
        b = torch.zeros(4, 3, dtype=torch.bool, device=dev)
        src = (torch.randn(4, 3, generator=_g()) * 10).to(dev)
        ints = torch.arange(12).reshape(4, 3).to(dev)  # int64
        for i in range(4):
            f[i] = ints[i]  # int64 -> float32
            n[i] = src[i]  # float32 -> int32 (truncated)
            b[i] = src[i]  # float32 -> bool
        h = torch.zeros(4, 3, dtype=torch.float16, device=dev)
        h[2] = src[1]
        return f, n, b, h

    def blocks(dev):  # slices and 2-d blocks, a transposed block among them
        a = torch.zeros(6, 4, 4, device=dev)
        src = torch.randn(4, 4, generator=_g()).to(dev)
        for i in range(6):
            a[i] = src.t() if i % 2 else src
        a[1:3, 1:3, 1:3] = src[:2, :2]
        a[4:, 0] = src[1:3]
        return a

    def within_one_buffer(dev):  # rows of `a` copied to other rows of `a`
        a = torch.randn(8, 3, generator=_g()).to(dev)
        for i in range(4):
            a[i] = a[7 - i]
        a[5] = a[5]  # the same view: nothing changes
        x = a[6]
        x.copy_(x)  # one tensor passed twice
        return a

    def repeated(dev):  # the same offsets again: adaptive queues and fuses them then
        a = torch.zeros(5, 2, device=dev)
        src = torch.randn(5, 2, generator=_g()).to(dev)
        for _ in range(3):
            for i in range(5):
                a[i] = src[i] + a[i]
        return a

    def views_of_views(dev):  # select of a select, narrow, unbind, as_strided
        a = torch.zeros(3, 4, 5, device=dev)
        src = torch.randn(3, 4, 5, generator=_g()).to(dev)
        for i in range(3):
            for j in range(4):
                a[i][j] = src[2 - i][3 - j]
        a.narrow(2, 1, 2)[1] = src[0, :, 3:]
        for k, r in enumerate(a[2].unbind(0)):
            r[k] = -1.0
        a.as_strided((2, 2), (5, 1), 7).copy_(src[0, 0, :4].view(2, 2))
        return a

    return {f.__name__: f for f in (rows_device, rows_host, negative, offset_base,
                                    non_contiguous, broadcast, dtypes, blocks,
                                    within_one_buffer, repeated, views_of_views)}


PROGRAMS = _programs()


def _values(out):
    outs = out if isinstance(out, tuple) else (out,)
    return [(o.dtype, tuple(o.shape), o.cpu()) for o in outs]


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_row_assignments_give_cpu_values(name, mode):
    want = _values(PROGRAMS[name]("cpu"))
    for _ in range(2):  # the second time: every signature seen before
        got = _values(PROGRAMS[name](N))
        assert [(d, s) for d, s, _ in got] == [(d, s) for d, s, _ in want]
        for (_, _, g), (_, _, w) in zip(got, want):
            assert torch.equal(g, w), (g, w)


ERRORS = {
    "shape": lambda dev: torch.zeros(4, 3, device=dev).__setitem__(
        1, torch.ones(2, device=dev)),
    "index": lambda dev: torch.zeros(4, 3, device=dev).__setitem__(
        -5, torch.ones(3, device=dev)),
    "partial_overlap": lambda dev: (lambda a: a[1:].copy_(a[:-1]))(
        torch.arange(6., device=dev)),
    "expanded_destination": lambda dev: torch.zeros(3, device=dev).expand(2, 3).copy_(
        torch.ones(2, 3, device=dev)),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_row_assignment_errors_are_cpus_at_the_call(name, mode):
    with pytest.raises(Exception) as cpu:
        ERRORS[name]("cpu")
    with pytest.raises(type(cpu.value)) as dev:
        ERRORS[name](N)
    assert str(dev.value) == str(cpu.value)
    a = torch.zeros(2, 2, device=N)  # the engine goes on
    a[1] = torch.ones(2, device=N)
    assert a.tolist() == [[0., 0.], [1., 1.]]


def _loop(n, kind):
    a = torch.zeros(n, 4, device=N)
    row = torch.ones(4, device=N)
    src = torch.randn(n, 4, generator=_g()).to(N)
    ae.synchronize()
    m0 = ae.metrics()
    for i in range(n):
        a[i] = row if kind == "row" else src[i]
    ae.synchronize()
    m1 = ae.metrics()
    assert torch.equal(a.cpu(), torch.ones(n, 4) if kind == "row" else src.cpu())
    return m1.compiles - m0.compiles, m1.launches - m0.launches


@pytest.mark.parametrize("kind", ["row", "src"])
def test_a_row_loop_compiles_nothing_per_row(kind, mode):
    """Each row is a view at a new offset: a new signature. The loop must not compile an
    executable per row (it did: ~500-900x CPU per assignment in eager mode), and in eager
    mode each assignment is one launch (a copy on the device)."""
    c1, l1 = _loop(40, kind)
    c2, l2 = _loop(160, kind)  # rows at offsets never seen
    assert c1 == c2 == 0
    if mode == "eager":
        assert (l1, l2) == (40, 160)
    else:
        assert l2 <= 160


def test_a_direct_copy_counts_as_an_eager_op():
    """Note [Direct copies]: one op, one launch with the bytes of its one-op executable, one
    flush of a group of one, no executable looked up."""
    a = torch.zeros(6, 4, device=N)
    src = torch.ones(4, device=N)
    ae.synchronize()
    m0 = ae.metrics()
    a[3] = src
    m1 = ae.metrics()
    assert m1.ops - m0.ops == 2  # select and copy_
    assert m1.launches - m0.launches == 1
    assert m1.flushes.get("eager", 0) - m0.flushes.get("eager", 0) == 1
    assert m1.hbm_bytes - m0.hbm_bytes == 16 * 3  # dst read and written, src read
    assert (m1.compiles, m1.cache_memory_hits, m1.cache_disk_hits) == (
        m0.compiles, m0.cache_memory_hits, m0.cache_disk_hits)


def test_select_at_any_index_is_cpus_view(mode):
    """Note [View inference]: `x.select(dim, i)` is the view at 0 shifted by i strides: every
    dim (negative too), index (negative too), base offset, stride (0 of an expanded tensor),
    and inference mode, as CPU's; out of range, CPU's error."""
    base = torch.randn(4, 5, 6, generator=_g())
    xs = [lambda t: t, lambda t: t[1:, 2:].transpose(0, 2), lambda t: t[:, :1].expand(4, 3, 6),
          lambda t: t[::2, 1::2]]
    for f in xs:
        c, n = f(base), f(base.to(N))
        for dim in range(-c.dim(), c.dim()):
            for i in range(-c.shape[dim], c.shape[dim]):
                got, want = n.select(dim, i), c.select(dim, i)
                assert (got.shape, got.stride(), got.storage_offset()) == (
                    want.shape, want.stride(), want.storage_offset())
                assert torch.equal(got.cpu(), want)
            for bad in (c.shape[dim], -c.shape[dim] - 1):
                with pytest.raises(IndexError) as e_cpu:
                    c.select(dim, bad)
                with pytest.raises(IndexError) as e_dev:
                    n.select(dim, bad)
                assert str(e_dev.value) == str(e_cpu.value)
    t = base.to(N)
    with torch.inference_mode():
        assert not t[2].is_inference() and t[2].equal(t[2])
        inf = torch.ones(3, 2, device=N)
    assert inf[1].is_inference() and inf[-1].tolist() == [1., 1.]


def test_views_of_an_empty_tensor_are_cpus(mode):
    """An empty tensor's views may sit past the end of its (empty) buffer, as CPU lets them:
    `select` at index 1 of a (2, 0) tensor, `.imag` of an empty complex one (fuzzer seeds 4907
    and 5113 raised 'setStorage: ... out of bounds' through select's runtime index)."""
    views = [lambda t: t.select(0, 1), lambda t: t.flatten(1).select(-2, 1),
             lambda t: t.narrow(0, 1, 1), lambda t: t[1:], lambda t: t.unfold(0, 1, 1),
             lambda t: torch.view_as_real(t.to(torch.complex64)).select(-1, 1),
             lambda t: (t.to(torch.complex64).conj() + 1).imag]
    for shape in [(2, 0, 3), (2, 1, 0)]:
        c, n = torch.zeros(shape), torch.zeros(shape, device=N)
        for f in views:
            got, want = f(n), f(c)
            assert (got.shape, got.stride(), got.storage_offset()) == (
                want.shape, want.stride(), want.storage_offset())
            assert torch.equal(got.cpu(), want)


def test_slice_at_any_offset_is_cpus_view(mode):
    """Note [View inference]: `x.slice(dim, i, j, step)` (`a[i:j]`, `narrow`) is the view at 0
    of the same length shifted by i strides: every dim, bound (negative, past the end, None),
    step, base offset and stride, as CPU's; a bad step or dim, CPU's error."""
    import itertools
    base = torch.randn(6, 5, 7, generator=_g())
    xs = [lambda t: t, lambda t: t[1:, 2:].transpose(0, 2), lambda t: t[:, :1].expand(6, 3, 7),
          lambda t: t[::2, 1::2]]
    bounds = [None, -9, -3, -1, 0, 1, 2, 4, 9, 2 ** 63 - 1]
    for f in xs:
        c, n = f(base), f(base.to(N))
        for dim in range(-c.dim(), c.dim()):
            for start, end, step in itertools.product(bounds, bounds, (1, 2, 3)):
                got = torch.ops.aten.slice.Tensor(n, dim, start, end, step)
                want = torch.ops.aten.slice.Tensor(c, dim, start, end, step)
                assert (got.shape, got.stride(), got.storage_offset()) == (
                    want.shape, want.stride(), want.storage_offset()), (dim, start, end, step)
                assert torch.equal(got.cpu(), want)
        for args in [(0, 1, 3, 0), (0, 1, 3, -1), (5, 1, 3, 1), (-4, 1, 3, 1)]:
            with pytest.raises((RuntimeError, IndexError)) as e_cpu:
                torch.ops.aten.slice.Tensor(c, *args)
            with pytest.raises(type(e_cpu.value)) as e_dev:
                torch.ops.aten.slice.Tensor(n, *args)
            assert str(e_dev.value) == str(e_cpu.value)
    t = base.to(N)
    assert torch.equal(t.narrow(1, 2, 3).cpu(), base.narrow(1, 2, 3))
    with torch.inference_mode():
        assert not t[2:4].is_inference() and t[2:4].equal(t[2:4])
        inf = torch.ones(5, 2, device=N)
    assert inf[1:3].is_inference() and inf[-2:].tolist() == [[1., 1.]] * 2


def test_slices_at_new_offsets_infer_no_signature(mode, monkeypatch):
    """`a[i:i + 2]` for every row i is one signature (the view at 0), not one per offset: no
    shape inference and no meta-cache entry per new offset (each cost ~50 us)."""
    from adaptive_eager.engine import engine as engine_mod
    a = torch.randn(64, 3, generator=_g())
    n = a.to(N)
    n[1:3], n.narrow(0, 1, 4), n[1:63]  # the views at 0 of lengths 2, 4, 62, inferred once
    calls = []
    for name in ("infer", "infer_view"):
        f = getattr(engine_mod, name)
        monkeypatch.setattr(engine_mod, name, lambda *a, _f=f, **k: calls.append(1) or _f(*a, **k))
    size = len(n._engine.meta_cache)
    for i in range(2, 60):
        assert torch.equal(n[i:i + 2].cpu(), a[i:i + 2])
        assert torch.equal(n.narrow(0, i, 4).cpu(), a.narrow(0, i, 4))
    assert torch.equal(n[2:].cpu(), a[2:])  # (its end: INT64_MAX, clamped; length 62)
    assert not calls
    assert len(n._engine.meta_cache) == size
