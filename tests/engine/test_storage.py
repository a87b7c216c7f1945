"""`t.storage()` of a neuron tensor: a TypedStorage over its device buffer with CUDA's
behaviour; `Tensor.set_` onto neuron storages and tensors; torch.library.opcheck on neuron.
Differential where CPU has the same question."""
import time
import warnings

import pytest
import torch

N = "neuron"

pytestmark = pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")


def test_storage_is_a_typed_storage_over_the_buffer_as_on_cuda():
    t = torch.arange(6., device=N)
    s = t.storage()
    assert isinstance(s, torch.TypedStorage)
    assert s.device == t.device and s.dtype == torch.float32
    assert s.size() == len(s) == 6 and s.nbytes() == 24 and t._typed_storage()._size() == 6
    assert s.data_ptr() == t.untyped_storage().data_ptr() == t.data_ptr()
    # identity: views share it, other tensors do not
    assert t[2:].storage().data_ptr() == s.data_ptr()
    assert t.view(2, 3).t().storage().data_ptr() == s.data_ptr()
    assert t.clone().storage().data_ptr() != s.data_ptr()
    assert s[4] == 4.0 and s.tolist() == t.cpu().tolist()
    assert s.cpu().tolist() == t.cpu().storage().tolist()


def test_storage_weak_references_as_pytorch_keys_storages(mode):
    """Note [Storage weak references]: `StorageWeakRef` (FakeTensor's constants, AOTAutograd's
    alias checks) raised AttributeError `_weak_ref` on a neuron storage. One reference per
    buffer, shared by its views, expiring with it."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef
    t = torch.ones(4, device=N) * 2
    ref = StorageWeakRef(t.untyped_storage())
    assert ref == StorageWeakRef(t[1:].view(3, 1).untyped_storage())
    assert ref == StorageWeakRef(t.storage())
    other = torch.ones(4, device=N)
    assert ref != StorageWeakRef(other.untyped_storage()) and not ref.expired()
    del t
    gc.collect()
    assert ref.expired() and other.tolist() == [1.0] * 4


def test_storage_repr_is_proportionate():
    """A failure report repr'd a storage element by element, a device read each (208 s)."""
    big = torch.zeros(2_000_000, device=N)
    start = time.perf_counter()
    text = repr(big.storage()) + repr(big.untyped_storage())
    elapsed = time.perf_counter() - start
    assert "of size 2000000" in text
    assert elapsed < 5, elapsed  # (one host copy: well under a second; generous for CI)
    small = torch.arange(3., device=N)
    assert str(small.storage()).splitlines()[:3] == str(small.cpu().storage()).splitlines()[:3]


def _set_cases(dev):
    base = torch.arange(6., device=dev)
    return [
        lambda t: t.set_(base.storage()),
        lambda t: t.set_(base.storage(), 2, (2,), (1,)),
        lambda t: t.set_(base.untyped_storage(), 1, (2, 2), (1, 2)),
        lambda t: t.set_(base.untyped_storage()),
        lambda t: t.set_(base),
        lambda t: t.set_(base, 1, (2,), (2,)),
        lambda t: t.set_(),
        lambda t: t.set_(base.storage(), 5, (3,), (1,)),  # out of bounds
        lambda t: t.set_(torch.zeros(3, dtype=torch.float64, device=dev).storage()),
        lambda t: t.set_(torch.zeros(2, dtype=torch.int64, device=dev)),
    ]


def test_set_onto_storages_and_tensors_matches_cpu(mode):
    for i in range(len(_set_cases("cpu"))):
        got = []
        for dev in ("cpu", N):
            t = torch.zeros(3, device=dev)
            v = t._version
            try:
                r = _set_cases(dev)[i](t)
                got.append((r is t, tuple(t.shape), t.stride(), t.storage_offset(),
                            t.cpu().tolist(), t._version - v))
            except RuntimeError as e:
                got.append(str(e))
        assert got[1] == got[0], i


def test_set_shares_the_buffer_both_ways(mode):
    base = torch.zeros(4, device=N)
    t = torch.empty(0, device=N).set_(base.storage(), 1, (2,), (1,))
    t += 5
    base[3] = 7
    assert base.cpu().tolist() == [0., 5., 5., 7.] and t.cpu().tolist() == [5., 5.]


def test_set_refuses_a_storage_on_another_device():
    t = torch.zeros(2, device=N)
    with pytest.raises(RuntimeError, match="devices must match"):
        t.set_(torch.zeros(2).storage())
    with pytest.raises(RuntimeError, match="devices must match"):
        torch.zeros(2).set_(torch.zeros(2, device=N))


def test_opcheck_passes_for_a_custom_op_on_neuron():
    @torch.library.custom_op("ae_test_storage::scale", mutates_args=())
    def scale(x: torch.Tensor, a: float) -> torch.Tensor:
        return x * a

    @scale.register_fake
    def _(x, a):
        return torch.empty_like(x)

    x = torch.randn(3, device=N)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = torch.library.opcheck(scale, (x, 2.0))
    assert set(result.values()) == {"SUCCESS"}, result


def test_dlpack_imports_host_capsules_and_refuses_export_clearly():
    import numpy as np
    c = torch.arange(3.)
    for made in (torch.asarray(c, device=N), torch.asarray(torch.utils.dlpack.to_dlpack(c),
                                                            device=N),
                 torch.from_dlpack(c).to(N), torch.from_dlpack(np.arange(3.)).to(N)):
        assert made.device.type == N and made.cpu().tolist() == [0., 1., 2.]
    t = torch.ones(2, device=N)
    for export in (lambda: torch.from_dlpack(t), lambda: t.__dlpack__(),
                   lambda: t.__dlpack_device__(), lambda: torch.utils.dlpack.to_dlpack(t),
                   lambda: np.from_dlpack(t)):
        with pytest.raises(RuntimeError, match="Can't export to dlpack a neuron:0 tensor.*t.cpu"):
            export()
