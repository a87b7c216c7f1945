"""torch.compile(backend="neuron") of code that hands a host (CPU) tensor to the device.

Found by the OpInfo compile scan (s17 compile-scan): `pack_padded_sequence` (its lengths are
a CPU tensor, by PyTorch's rule) and `histogramdd` failed to compile on neuron only, with
FakeTensor's "you set no_dispatch() before calling into this function" assertion, where CPU
under backend="aot_eager" compiles them. The engine's `isinstance(v, torch.Generator)` on
that CPU tensor calls `torch._opaque_base.OpaqueBaseMeta.__instancecheck__` (torch.Generator's
metaclass, a Python frame), which Dynamo's frame hook, still set while the engine runs,
tries to compile: it fakeifies the CPU tensor inside `__torch_dispatch__` and asserts.
"""
import copy

import pytest
import torch
import torch.nn as nn

import adaptive_eager  # noqa: F401


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/integration/conftest.py


def _packed(x):
    return nn.utils.rnn.pack_padded_sequence(x, [3, 2], enforce_sorted=True).data * 2


def _histogramdd(x, b0, b1):
    return torch.histogramdd(x, bins=[b0, b1])[0]


@pytest.mark.parametrize("fn, args", [
    (_packed, lambda: [torch.randn(3, 2, 4)]),
    (_histogramdd, lambda: [torch.randn(6, 2), torch.tensor([-3., 0., 3.]),
                            torch.tensor([-3., -1., 0., 3.])]),
], ids=["pack_padded_sequence", "histogramdd"])
def test_compiled_op_with_a_host_tensor_argument_matches_cpu(fn, args):
    torch.manual_seed(0)
    cpu_args = args()
    ref = fn(*cpu_args)
    got = torch.compile(fn, backend="neuron")(*[a.to("neuron") for a in cpu_args])
    torch.testing.assert_close(got.cpu(), ref)


def test_compiled_packed_gru_matches_cpu():
    torch.manual_seed(0)
    rnn = nn.GRU(3, 4)
    x = torch.randn(5, 2, 3)

    def f(rnn, x):
        out, _ = rnn(nn.utils.rnn.pack_padded_sequence(x, [5, 3], enforce_sorted=True))
        return nn.utils.rnn.pad_packed_sequence(out)[0]
    rnn_n = copy.deepcopy(rnn).to("neuron")
    ref = f(rnn, x)
    got = torch.compile(f, backend="neuron")(rnn_n, x.to("neuron"))
    torch.testing.assert_close(got.cpu(), ref)
