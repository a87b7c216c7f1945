"""The OpInfo and ModuleInfo harnesses (test_opinfo.py, test_opinfo_grad.py, test_modules.py)
can fail: wrong values, wrong gradients, None-ness differences and leaves that cannot be
compared are all reported."""
import pytest
import torch

pytest.importorskip("expecttest")
from torch.testing._internal.common_dtype import floating_types  # noqa: E402
from torch.testing._internal.opinfo.core import OpInfo, SampleInput  # noqa: E402

from tests.conformance import test_opinfo as fwd  # noqa: E402
from tests.conformance import test_opinfo_grad as grad  # noqa: E402

Mismatch = fwd.Mismatch


class _Uncomparable:
    def __eq__(self, other):
        raise TypeError("no equality")


def test_compare_uncomparable_leaf_fails():
    x = _Uncomparable()
    with pytest.raises(Mismatch, match="cannot compare"):
        fwd.compare([x], [x])


def test_compare_tensor_vs_number_fails():
    with pytest.raises(Mismatch, match="expected a float, got Tensor"):
        fwd.compare([torch.tensor(1.0)], [1.0])
    with pytest.raises(Mismatch, match="expected a tensor"):
        fwd.compare([1.0], [torch.tensor(1.0)])


def test_compare_type_mismatch_fails():
    with pytest.raises(Mismatch, match="expected a int, got float"):
        fwd.compare([2.0], [2])


def test_compare_strides_differing_fails():
    x = torch.arange(6.).view(2, 3)
    with pytest.raises(Mismatch, match="strides"):
        fwd.compare(fwd._to_cpu([x.mT.contiguous()]), fwd._to_cpu([x.mT]))
    fwd.compare(fwd._to_cpu([x[:1]]), fwd._to_cpu([x[:1].contiguous()]))  # size-1 dims free


def test_compare_equal_plain_leaves_pass():
    fwd.compare([1, 2.0, None, torch.float32, "x"], [1, 2.0, None, torch.float32, "x"])


def test_compare_grads_none_vs_zeros_fails():
    with pytest.raises(Mismatch, match="None, expected a tensor"):
        grad.compare_grads([None], [torch.zeros(2)])
    with pytest.raises(Mismatch, match="a tensor, expected None"):
        grad.compare_grads([torch.zeros(2)], [None])
    grad.compare_grads([None, torch.ones(2)], [None, torch.ones(2)])


def test_weights_are_fixed_and_per_output():
    a = (torch.zeros(3, requires_grad=True) * 1, torch.zeros(2, dtype=torch.long))
    w1, w2 = grad.weights_for(a), grad.weights_for(a)
    assert w1[1] is None and w1[0].shape == (3,)
    assert torch.equal(w1[0], w2[0])


class _WrongOnNeuron(torch.autograd.Function):
    """y = 2x; the backward is right on CPU and doubled on any other device."""

    @staticmethod
    def forward(ctx, x):
        ctx.device = x.device.type
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * (2 if ctx.device == "cpu" else 4)


def _unused_second(x, y):
    """Uses only x: CPU's gradient for y is None."""
    return x * 3


def _samples_one(op, device, dtype, requires_grad, **kw):
    yield SampleInput(torch.randn(4, 3, device=device, dtype=dtype,
                                  requires_grad=requires_grad))


def _samples_two(op, device, dtype, requires_grad, **kw):
    mk = lambda: torch.randn(4, 3, device=device, dtype=dtype,  # noqa: E731
                             requires_grad=requires_grad)
    yield SampleInput(mk(), args=(mk(),))


def _opinfo(name, fn, samples):
    return OpInfo(name, op=fn, dtypes=floating_types(), sample_inputs_func=samples,
                  supports_out=False, inplace_variant=None, method_variant=None)


def test_grad_harness_catches_a_wrong_gradient():
    res = grad.run_op(_opinfo("wrong_grad_on_neuron", _WrongOnNeuron.apply, _samples_one))
    assert res.skipped is None and res.samples == 1
    assert set(res.errors) == set(fwd.MODES), res.errors
    assert all("values differ" in e for e in res.errors.values()), res.errors


def test_grad_harness_passes_a_right_gradient():
    res = grad.run_op(_opinfo("right_grad", lambda x: x * 2, _samples_one))
    assert res.skipped is None and res.samples == 1 and not res.errors, res


def test_grad_harness_keeps_none_for_unused_inputs():
    res = grad.run_op(_opinfo("unused_input", _unused_second, _samples_two))
    assert res.skipped is None and res.samples == 1 and not res.errors, res


def test_forward_harness_catches_a_wrong_value():
    def wrong(x):
        return x * (2 if x.device.type == "cpu" else 3)
    res = fwd.run_op(_opinfo("wrong_value_on_neuron", wrong, _samples_one))
    assert res.skipped is None and set(res.errors) == set(fwd.MODES), res.errors


def _fake_child(tmp_path, monkeypatch, body):
    script = tmp_path / "child.py"
    script.write_text("import os, sys\n" + body)
    monkeypatch.setattr(grad, "__file__", str(script))


def test_isolated_mode_whose_child_dies_fails(tmp_path, monkeypatch):
    _fake_child(tmp_path, monkeypatch, "sys.stderr.write('boom\\n'); os.abort()\n")
    res = grad.run_op_isolated(_opinfo("any", lambda x: x, _samples_one), ("adaptive",))
    assert list(res.errors) == ["adaptive"]
    assert res.errors["adaptive"].startswith("process died (exit code -6): boom")


def test_isolated_mode_reads_the_child_result(tmp_path, monkeypatch):
    _fake_child(tmp_path, monkeypatch, 'print(\'{"skipped": null, "samples": 2, '
                                       '"errors": {"matmul": "x"}}\')\n')
    res = grad.run_op_isolated(_opinfo("any", lambda x: x, _samples_one), ("matmul",))
    assert res.errors == {"matmul": "x"} and res.samples == 2 and res.skipped is None


# ------------------------------------------------------------------------------------------
# The ModuleInfo harness (test_modules.py)
# ------------------------------------------------------------------------------------------
from torch.testing._internal.common_modules import (FunctionInput, ModuleInfo,  # noqa: E402
                                                    ModuleInput)

from tests.conformance import test_modules as mod  # noqa: E402


class _Scale(torch.nn.Module):
    """y = w * x with a running count of steps (a buffer); `wrong` says which part is wrong
    off the CPU: "grad" (the weight's gradient doubled), "buffer" (the count off by one),
    "second" (the output of the second call onwards) or None (right everywhere)."""

    def __init__(self, wrong=None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))
        self.register_buffer("count", torch.zeros(()))
        self.wrong = wrong

    def forward(self, x):
        off = x.device.type != "cpu"
        self.count += 2 if off and self.wrong == "buffer" else 1
        w = _WrongOnNeuron.apply(self.w) / 2 if self.wrong == "grad" else self.w
        if off and self.wrong == "second" and self.count.item() > 1:
            return w * x + 1
        return w * x


def _module_info(wrong):
    def inputs(module_info, device, dtype, requires_grad, training, **kw):
        x = torch.randn(4, 3, device=device, dtype=dtype, requires_grad=requires_grad)
        return [ModuleInput(FunctionInput(wrong), forward_input=FunctionInput(x))]
    return ModuleInfo(_Scale, module_inputs_func=inputs)


@pytest.mark.parametrize("wrong, says", [("grad", "parameter grads: grad 0 0: values differ"),
                                         ("buffer", "buffer 0: values differ"),
                                         ("second", "output 1: values differ")])
def test_module_harness_catches_a_wrong_value(wrong, says):
    res = mod.run_module(_module_info(wrong))
    assert res.skipped is None and res.samples == 1
    assert set(res.errors) == set(fwd.MODES), res.errors
    assert all(says in e for e in res.errors.values()), res.errors


def test_module_harness_passes_a_right_module():
    res = mod.run_module(_module_info(None))
    assert res.skipped is None and res.samples == 1 and not res.errors, res
