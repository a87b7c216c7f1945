"""Errors in CPU's (CUDA's) words at the boundary: cross-device block_diag, linspace/logspace
dtype errors, sparse and quantized tensors refused clearly."""
import warnings

import pytest
import torch

N = "neuron"


def _error(f):
    try:
        f()
    except Exception as e:  # noqa: BLE001 (compared)
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("f", [
    lambda d: torch.linspace(1j, 2j, 3, dtype=torch.float32, device=d),
    lambda d: torch.logspace(1j, 2j, 3, dtype=torch.float32, device=d),
    lambda d: torch.linspace(torch.tensor(1j), torch.tensor(2j), 3, dtype=torch.float32,
                             device=d),
    lambda d: torch.logspace(torch.tensor(1j), 2, 3, dtype=torch.int64, device=d),
    lambda d: torch.linspace(0, 1, 3, dtype=torch.bool, device=d),
    lambda d: torch.logspace(0, 1, 3, dtype=torch.bool, device=d),
    lambda d: torch.linspace(0, 1, -1, device=d),
])
def test_linspace_and_logspace_errors_are_cpus(f):
    cpu = _error(lambda: f("cpu"))
    assert cpu is not None and _error(lambda: f(N)) == cpu


def test_block_diag_across_devices_says_what_cpu_and_cuda_say(mode):
    a, b = torch.ones(2, 2), torch.ones(2, 2, device=N)
    with pytest.raises(RuntimeError, match=r"^torch.block_diag: input tensors must all be on "
                       r"the same device. Input 0 is on device cpu and input 1 is on device "
                       r"neuron:0$"):
        torch.block_diag(a, b)
    with pytest.raises(RuntimeError, match="Input 0 is on device neuron:0 and input 1 is on "
                       "device cpu"):
        torch.block_diag(b, a)
    assert torch.block_diag(b, b * 2).cpu().tolist() == torch.block_diag(a, a * 2).tolist()


def test_a_sparse_csr_tensor_on_neuron_is_refused_as_sparse_not_as_two_devices(mode):
    csr = torch.eye(2).to_sparse_csr().to(N)  # (made in C++: no hook refuses it there)
    dense = torch.ones(2, 2, device=N)
    for f in (lambda: torch.mm(csr, dense), lambda: torch.sparse.sampled_addmm(csr, dense, dense),
              lambda: csr.to_dense()):
        with pytest.raises(NotImplementedError, match="sparse layouts .* not supported on the "
                           "neuron device"):
            f()
    assert (dense + 1).cpu().tolist() == [[2., 2.], [2., 2.]]  # the engine still works


def test_a_nested_result_is_refused_in_words_that_say_so(mode):
    """nn.TransformerEncoder's default (enable_nested_tensor=True) in eval under no_grad with
    a padding mask makes a nested tensor (a CPU fallback here): it failed with PyTorch's
    "Internal error: NestedTensorImpl doesn't support sizes"; now it is refused clearly, with
    the way out, and the engine goes on."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    m = torch.nn.TransformerEncoder(layer, 2).to(N).eval()
    x = torch.randn(2, 3, 8).to(N)
    pad = torch.tensor([[False, False, False], [False, False, True]]).to(N)
    with torch.no_grad(), warnings.catch_warnings(), pytest.raises(
            NotImplementedError, match="nested tensors are not supported on the neuron device"
            ".*enable_nested_tensor=False"):
        warnings.simplefilter("ignore")  # (its fallback's warning)
        m(x, src_key_padding_mask=pad)
    assert m(x, src_key_padding_mask=pad).shape == (2, 3, 8)  # (with grad: no nested path)


def test_quantized_tensors_are_refused_at_the_boundary(mode):
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    for f in (lambda: q.to(N), lambda: q.flatten().to(N), lambda: q.flip(0).to(N),
              lambda: torch.quantize_per_tensor(torch.randn(4, device=N), 0.1, 0,
                                                torch.qint8)):
        with pytest.raises(NotImplementedError, match="quantized tensors .* not supported on "
                           "the neuron device"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                f()
    assert (torch.ones(2, device=N) * 3).cpu().tolist() == [3., 3.]


def test_deterministic_index_put_matches_cpu(mode):
    """index_put_'s deterministic path made new memory whose fill (NaN, under
    `fill_uninitialized_memory`) ran below the Python key: `aten::as_strided` had no kernel."""
    def run(dev):
        x = torch.zeros(5, device=dev)
        x.index_put_((torch.tensor([0, 2, 0], device=dev),),
                     torch.tensor([1., 2., 3.], device=dev), accumulate=True)
        w = torch.zeros(4, 3, device=dev)
        w.index_put_((torch.tensor([0, 0, 2], device=dev),), torch.ones(3, 3, device=dev),
                     accumulate=True)
        y = torch.zeros(3, 2, device=dev)
        y[torch.tensor([1, 1], device=dev)] = torch.ones(2, 2, device=dev)
        return x.cpu().tolist(), w.cpu().tolist(), y.cpu().tolist(), \
            torch.empty(3, device=dev).cpu().isnan().tolist()
    torch.use_deterministic_algorithms(True)
    try:
        assert run(N) == run("cpu")
    finally:
        torch.use_deterministic_algorithms(False)


def test_as_strided_below_the_python_key_is_a_view_of_the_buffer():
    t = torch.arange(6., device=N)
    with torch._C._DisableTorchDispatch():
        v = torch.ops.aten.as_strided.default(t, (2, 2), (1, 2), 1)
    assert v.cpu().tolist() == [[1., 3.], [2., 4.]]
    with pytest.raises(RuntimeError, match="out of bounds for storage"):
        with torch._C._DisableTorchDispatch():
            torch.ops.aten.as_strided.default(t, (3, 3), (3, 1), 0)
