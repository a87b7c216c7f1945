"""Where a tensor's copy goes and what it keeps, as on CPU: factories shaped like a neuron
tensor with another `device=`, `.to("meta")`, `copy.copy`, `copy.deepcopy` and pickling of a
tensor's `.grad` and Python attributes (each failed before its fix)."""
import copy
import io

import pytest
import torch

import adaptive_eager as ae  # noqa: F401

N = "neuron"


@pytest.mark.parametrize("factory", [
    lambda x, d: torch.zeros_like(x, device=d), lambda x, d: torch.ones_like(x, device=d),
    lambda x, d: torch.full_like(x, 3.0, device=d), lambda x, d: torch.empty_like(x, device=d),
    lambda x, d: x.new_zeros(2, device=d), lambda x, d: x.new_full((2,), 7, device=d),
    lambda x, d: x.new_empty_strided((2, 3), (1, 2), device=d),
    lambda x, d: torch.randint_like(x, 10, device=d), lambda x, d: x.to(d)])
@pytest.mark.parametrize("target", ["cpu", "meta", "neuron:1"])
def test_a_factory_like_a_neuron_tensor_makes_its_result_on_the_device_asked(mode, factory,
                                                                          target):
    """`zeros_like(x, device="cpu")` of a neuron x was a neuron tensor, `x.to("meta")` too."""
    x = torch.randn(4, 5).t()
    out = factory(x.to(N), target)
    ref = factory(x, "meta")
    assert out.device == torch.device(target)
    assert (out.shape, out.stride(), out.dtype) == (ref.shape, ref.stride(), ref.dtype)
    if target == "cpu" and factory(x, "cpu").dtype.is_floating_point \
            and "empty" not in str(factory.__code__.co_names):
        torch.manual_seed(0)
        a = factory(x, "cpu")
        torch.manual_seed(0)
        assert torch.equal(factory(x.to(N), "cpu"), a)


def test_a_module_goes_to_meta(mode):
    m = torch.nn.Linear(2, 2).to(N)
    m.to("meta")
    assert m.weight.device.type == "meta" and m.bias.device.type == "meta"


def test_copy_copy_aliases_the_buffer(mode):
    """copy.copy of a neuron tensor was a CPU copy: writes through it were lost."""
    x = torch.zeros(3, device=N, requires_grad=True)
    x.tag = 1
    y = copy.copy(x)
    with torch.no_grad():
        y.add_(1)
    assert y.device == x.device and y is not x and y.tag == 1 and y.requires_grad
    assert x.tolist() == [1.0, 1.0, 1.0]
    p = torch.nn.Linear(2, 2).to(N).weight
    assert isinstance(copy.copy(p), torch.nn.Parameter)


def _attributes(d):
    t = torch.ones(2, device=d, requires_grad=True)
    t.grad = torch.full((2,), 5.0, device=d)
    t.tag = "x"
    m = torch.nn.Linear(2, 2).to(d)
    m.weight._no_weight_decay = True
    m.weight.grad = torch.ones(2, 2, device=d)
    return t, m


def test_deepcopy_keeps_grad_and_attributes_as_cpu(mode):
    """deepcopy of a neuron tensor dropped its .grad and Python attributes (a Parameter's are
    dropped on CPU too)."""
    def kept(d):
        t, m = _attributes(d)
        c, w = copy.deepcopy(t), copy.deepcopy(m).weight
        return (c.grad.tolist(), c.tag, c.requires_grad, w.grad,
                getattr(w, "_no_weight_decay", None), isinstance(w, torch.nn.Parameter))
    assert kept(N) == kept("cpu")


@pytest.mark.parametrize("weights_only", [True, False])
def test_save_keeps_python_attributes_as_cpu(mode, weights_only):
    """torch.save of a neuron tensor or Parameter dropped its Python attributes."""
    def kept(d, loc):
        t, m = _attributes(d)
        b = io.BytesIO()
        torch.save({"t": t, "w": m.weight, "m": m} if not weights_only else
                   {"t": t, "w": m.weight}, b)
        b.seek(0)
        r = torch.load(b, weights_only=weights_only, map_location=loc)
        out = [r["t"].tag, r["w"]._no_weight_decay, r["t"].tolist(), r["t"].device.type]
        if not weights_only:
            out += [r["m"].weight is r["w"], r["m"].weight._no_weight_decay]
        return out
    for loc in (None, "cpu"):
        ref = kept("cpu", loc)
        ref[3] = "cpu" if loc == "cpu" else N
        assert kept(N, loc) == ref


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16,
                                   torch.uint32, torch.uint64])
def test_save_and_load_of_the_new_dtypes(mode, dtype):
    """torch.save of a float8 / uint16 neuron tensor raised KeyError; a CPU one loaded with
    map_location="neuron" stayed on the CPU (their format sets the storage directly)."""
    x = torch.arange(6).to(dtype)
    for src, loc in ((N, None), (N, "cpu"), ("cpu", N)):
        t = x.to(src)
        b = io.BytesIO()
        torch.save([t, t[2:]], b)
        b.seek(0)
        r = torch.load(b, map_location=loc)
        want = torch.device(loc or src)
        assert [v.device.type for v in r] == [want.type] * 2
        assert [v.cpu().view(torch.uint8).tolist() for v in r] == \
            [x.view(torch.uint8).tolist(), x[2:].view(torch.uint8).tolist()]


def test_dlpack_export_refuses_a_neuron_tensor():
    """to_dlpack / __dlpack__ packed a null pointer of device "ext": the importer got a
    tensor that failed later with unrelated errors."""
    x = torch.arange(4.0, device=N)
    for export in (torch.utils.dlpack.to_dlpack, torch.to_dlpack, lambda t: t.__dlpack__()):
        with pytest.raises(RuntimeError, match="Can't export to dlpack a neuron:0 tensor"):
            export(x)
    assert torch.from_dlpack(torch.utils.dlpack.to_dlpack(x.cpu())).tolist() == x.tolist()


def test_untyped_storage_copies_and_queries_as_cpu(mode):
    """untyped_storage() had no element_size, is_pinned, cpu, clone or tolist."""
    def run(d):
        x = torch.arange(4, dtype=torch.int16, device=d)
        x.add_(1)
        s = x.untyped_storage()
        c = s.clone()
        x.add_(1)  # the clone is a copy, not an alias
        return (s.element_size(), s.is_pinned(), s.is_shared(), s.cpu().tolist(), s.tolist(),
                c.tolist(), c.data_ptr() != s.data_ptr(), s.cpu().device.type)
    assert run(N) == run("cpu")


def test_a_device_storage_constructor_raises_instead_of_crashing():
    """torch.UntypedStorage(n, device="neuron") reached PrivateUse1's missing C++ allocator:
    a segmentation fault (run in a child process, so the old crash fails only this test)."""
    import subprocess
    import sys
    code = ("import torch, warnings\nwarnings.simplefilter('ignore')\n"
            "for make in (lambda: torch.UntypedStorage(4, device='neuron'),\n"
            "             lambda: torch.TypedStorage(4, device='neuron', dtype=torch.float32),\n"
            "             lambda: torch.UntypedStorage(4)._new_shared(4, device='neuron')):\n"
            "    try:\n        make()\n    except RuntimeError as e:\n"
            "        assert 'made through tensors' in str(e), e\n"
            "print(torch.UntypedStorage(3).nbytes(), torch.UntypedStorage([1, 2]).nbytes())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["3", "2"], out.stderr[-2000:]


@pytest.mark.parametrize("copy", ["0-d host value", "host", "to host", "device"])
def test_a_copy_counts_one_op(mode, copy):
    """Each `copy_` is one op in the metrics, as every op is (the copy of a 0-d host value
    into a device tensor was counted twice: by its handler and by the op path it takes)."""
    dst = torch.zeros(3, device=N)
    src = {"0-d host value": torch.tensor(2.0), "host": torch.ones(3),
           "to host": torch.ones(3, device=N), "device": torch.ones(3, device=N)}[copy]
    target = torch.zeros(3) if copy == "to host" else dst
    torch.neuron.synchronize()
    before = ae.metrics().ops
    target.copy_(src)
    assert ae.metrics().ops - before == 1
    assert torch.equal(target.cpu(), torch.full((3,), 2.0 if copy.startswith("0-d") else 1.0))
