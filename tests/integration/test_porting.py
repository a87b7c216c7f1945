"""What a port to neuron relies on, as real programs use it: parameters keep identity and
ties across `.to("neuron")`, checkpoints load the way PyTorch's own do, generators and sparse
layouts are refused in PyTorch's words, and autograd's zero tensors work."""
import copy
import io
import os
import subprocess
import sys

import pytest
import torch

import adaptive_eager as ae  # noqa: F401  (registers the device)
from adaptive_eager.integration.native import loaded as native_loaded


# -- 1. Module.to keeps parameter identity and ties -------------------------------------------
def _tied():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(7, 4)
    head = torch.nn.Linear(4, 7, bias=False)
    head.weight = emb.weight  # an lm_head tied to the embedding
    return torch.nn.Sequential(emb, torch.nn.Tanh(), head)


def test_to_keeps_parameter_identity_and_ties():
    m = _tied()
    w, n = m[0].weight, len(list(m.parameters()))
    m.to("neuron")
    assert m[0].weight is w and m[2].weight is w
    assert len(list(m.parameters())) == n == 1
    assert isinstance(w, torch.nn.Parameter) and w.is_leaf and w.requires_grad
    assert w.device.type == "neuron"


def test_parameter_shared_across_modules_stays_shared():
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    b.weight = a.weight
    outer = torch.nn.ModuleDict({"a": a, "b": b})
    outer.to("neuron")
    assert a.weight is b.weight
    with torch.no_grad():
        a.weight.add_(1)  # one tensor: the update shows through both modules
    assert torch.equal(b.weight.cpu(), a.weight.cpu())


def test_grad_moves_with_its_parameter():
    m = torch.nn.Linear(3, 2)
    m(torch.ones(1, 3)).sum().backward()
    w, g = m.weight, m.weight.grad.clone()
    m.to("neuron")
    assert m.weight is w and w.grad.device.type == "neuron"
    assert torch.equal(w.grad.cpu(), g)


def test_to_keeps_the_parameters_python_attributes():
    """A swap exchanges `__dict__`s: `.to("neuron")` dropped flags set on parameters
    (`_no_weight_decay`, which decides an optimizer's param groups), which CUDA keeps."""
    m = torch.nn.Linear(3, 2)
    m.bias._no_weight_decay = True
    m.weight.grad = torch.ones(2, 3)
    m.weight.grad.tag = "g"
    m.to("neuron")
    assert m.bias._no_weight_decay is True and not hasattr(m.weight, "_no_weight_decay")
    assert m.weight.grad.tag == "g" and m.weight.grad.device.type == "neuron"
    decay = [p for p in m.parameters() if not getattr(p, "_no_weight_decay", False)]
    assert decay == [m.weight]
    y = torch.ones(3).to("neuron")
    assert not hasattr(y, "_no_weight_decay")  # a plain .to copies no attributes
    a, b = torch.ones(2), torch.ones(2, device="neuron")
    a.tag = "a"
    torch.utils.swap_tensors(a, b)  # a user's own swap stays PyTorch's
    assert b.tag == "a" and not hasattr(a, "tag") and a.device.type == "neuron"


@pytest.mark.parametrize("back", [None, "cpu()"])
def test_gradient_hooks_registered_before_to_keep_running(back):
    """A swap leaves autograd's hooks with the tensor swapped out: a gradient hook registered
    on a parameter before `.to("neuron")` (or `.cpu()`) silently stopped running, where CUDA's
    `.data =` keeps it. A removed hook stays removed."""
    m = torch.nn.Linear(3, 2)
    seen = []
    m.bias.register_hook(lambda g: g * 0)  # a gradient mask
    removed = m.weight.register_hook(lambda g: seen.append("removed"))
    m.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.device.type))
    m.to("neuron")
    removed.remove()
    if back:
        eval(f"m.{back}")
    device = "cpu" if back else "neuron"
    m(torch.ones(1, 3, device=device)).sum().backward()
    assert seen == [device]
    assert torch.equal(m.bias.grad.cpu(), torch.zeros(2))


def test_lazy_modules_say_to_initialize_before_moving():
    m = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.ReLU())
    with pytest.raises(RuntimeError, match=r"uninitialized UninitializedParameter .* dry run"):
        m.to("neuron")
    x = torch.randn(3, 5)
    expected = m(x)  # the dry run
    m.to("neuron")
    assert torch.equal(m(x.to("neuron")).cpu(), expected)


def _train(device, mode_ctx):
    m = _tied()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)  # built before .to, as users do
    m.to(device)
    x = torch.tensor([1, 2, 5]).to(device)
    losses = []
    with mode_ctx():
        for _ in range(3):
            loss = m(x).logsumexp(-1).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


def test_optimizer_built_before_to_trains_the_tied_model_as_on_cpu():
    import contextlib
    cpu = _train("cpu", contextlib.nullcontext)
    eager = _train("neuron", contextlib.nullcontext)
    torch.testing.assert_close(eager, cpu, rtol=1e-5, atol=1e-6)
    assert eager[0] != eager[2]  # the optimizer did update the device parameters
    for strategy in ("graph", "matmul"):
        assert _train("neuron", lambda: ae.adaptive(strategy=strategy)) == eager


def test_parameter_repr_as_on_cuda():
    p = torch.nn.Linear(2, 1).to("neuron").weight
    assert repr(p).startswith("Parameter containing:\ntensor([[")
    assert repr(p).endswith("device='neuron:0', requires_grad=True)")


def test_back_to_cpu_keeps_ties_with_torch_swap_flag():
    m = _tied().to("neuron")
    w = m[0].weight
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        m.cpu()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert m[0].weight is w and m[2].weight is w and w.device.type == "cpu"
    assert type(w) is torch.nn.Parameter


@pytest.mark.parametrize("back", ["cpu()", "to('cpu')", "to('neuron:1')"])
def test_back_to_cpu_keeps_parameters_ties_grads_and_attributes(back):
    """Issue 24: `.cpu()` made new CPU Parameters (a wrapper subclass and the CPU are not
    `.data`-compatible types): ties came undone silently and optimizers kept the old ones."""
    m = _tied().to("neuron")
    w = m[0].weight
    w._no_weight_decay = True
    m(torch.tensor([1, 2]).to("neuron")).sum().backward()
    g = w.grad
    expected = w.grad.cpu()
    eval(f"m.{back}")
    device = "neuron:1" if "neuron" in back else "cpu"
    assert m[0].weight is w and m[2].weight is w and w.device == torch.device(device)
    assert w.grad is g and g.device == w.device and torch.equal(g.cpu(), expected)
    assert w._no_weight_decay is True and isinstance(w, torch.nn.Parameter) and w.is_leaf
    assert not hasattr(w, "_handle") or type(w) is not torch.nn.Parameter
    if device == "cpu":
        assert type(w) is torch.nn.Parameter and type(g) is torch.Tensor


def test_back_to_cpu_while_a_graph_holds_the_parameter_raises_not_unties():
    m = _tied().to("neuron")
    w = m[0].weight
    out = m(torch.tensor([1, 2]).to("neuron")).sum()  # the graph holds w
    with pytest.raises(RuntimeError, match="Couldn't swap"):
        m.cpu()
    assert m[0].weight is w and m[2].weight is w
    out.backward()  # nothing was half-moved: the device step still runs
    assert w.grad.device.type == "neuron"


def test_a_move_that_fails_midway_moves_nothing():
    """Note [A failed move moves nothing]: the graph holds the Linear's weight, not the
    Embedding's before it, so `_apply` swapped the Embedding to the CPU, then raised: the
    model was left on two devices. Now parameters, their gradients and buffers are all where
    they were, with their values, and a later move (the graph gone) moves everything."""
    m = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4),
                            torch.nn.BatchNorm1d(4)).to("neuron")
    m[0].weight.grad = torch.ones(5, 4, device="neuron")
    out = m(torch.tensor([1, 2], device="neuron")).sum()  # saves Linear.weight, not Embedding's
    params, values = list(m.parameters()), [t.detach().cpu() for t in m.state_dict().values()]
    with pytest.raises(RuntimeError, match="Couldn't swap Linear.weight"):
        m.cpu()
    assert list(m.parameters()) == params
    assert {t.device.type for t in [*m.parameters(), *m.buffers(), m[0].weight.grad]} == \
        {"neuron"}
    assert all(torch.equal(v, t.cpu()) for v, t in zip(values, m.state_dict().values()))
    del out
    m.cpu()
    assert {t.device.type for t in [*m.parameters(), *m.buffers(), m[0].weight.grad]} == {"cpu"}
    out = m(torch.tensor([1, 2])).sum()  # the same, from the CPU to the device
    with pytest.raises(RuntimeError, match="Couldn't swap Linear.weight"):
        m.to("neuron")
    assert {t.device.type for t in [*m.parameters(), *m.buffers(), m[0].weight.grad]} == {"cpu"}


def test_cpu_modules_and_half_on_neuron_keep_the_data_path():
    """The swap is asked for only for modules holding neuron parameters, and there only
    where `.data =` cannot do the conversion: `.half()` on the device works while an autograd
    graph still holds the parameter, as on CUDA."""
    lin = torch.nn.Linear(2, 2).to("neuron")
    w = lin.weight
    out = lin(torch.ones(1, 2).to("neuron")).sum()
    lin.double()  # float64 runs as float32 on the device, with one warning
    lin.half()
    assert lin.weight is w and w.dtype == torch.float16
    del out
    cpu = torch.nn.Linear(2, 2)
    keep = cpu(torch.ones(1, 2)).sum()  # noqa: F841  (a graph holds the CPU weight)
    w = cpu.weight
    cpu.half()
    assert cpu.weight is w


def test_optimizer_built_before_a_round_trip_keeps_training():
    """Trained on neuron, evaluated on the CPU (`.cpu()`), back to neuron: the optimizer
    built before any move still trains the model (its state stays where it was made, as
    on CUDA: a step is taken on the device the state lives on)."""
    def run(device, evaluate_on):
        m = _tied()
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        x = torch.tensor([1, 2, 5])
        losses = []
        for step in range(4):
            m.to(device)
            loss = m(x.to(device)).logsumexp(-1).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            m.to(evaluate_on)
            with torch.no_grad():
                losses.append(m(x.to(evaluate_on)).logsumexp(-1).mean().item())
        return losses, m
    cpu, m_cpu = run("cpu", "cpu")
    trip, m_trip = run("neuron", "cpu")
    assert trip == cpu and cpu[0] != cpu[6]
    assert m_trip[0].weight is m_trip[2].weight
    assert torch.equal(m_trip[0].weight.cpu(), m_cpu[0].weight)


def test_deepcopy_keeps_parameters():
    m = copy.deepcopy(_tied().to("neuron"))
    assert all(isinstance(p, torch.nn.Parameter) for p in m.parameters())
    assert m[0].weight is m[2].weight


# -- 2. Checkpoints -----------------------------------------------------------------------------
def _saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_torch_load_default_weights_only_gives_neuron_tensors():
    sd = _tied().to("neuron").state_dict()
    loaded = torch.load(_saved(sd))  # weights_only=True: the default
    assert loaded.keys() == sd.keys()
    for k, v in loaded.items():
        assert v.device.type == "neuron" and v.dtype == sd[k].dtype
        assert torch.equal(v.cpu(), sd[k].cpu())


def test_torch_load_map_location_cpu_gives_plain_cpu_tensors():
    x = torch.arange(6.0, device="neuron").reshape(2, 3).t()
    y = torch.load(_saved({"x": x}), map_location="cpu")["x"]
    assert type(y) is torch.Tensor and y.device.type == "cpu"
    assert torch.equal(y, x.cpu())


@pytest.mark.parametrize("where", ["neuron", "neuron:0", torch.device("neuron", 0),
                                   {"cpu": "neuron:0"}])
def test_a_cpu_checkpoint_loads_onto_the_device(where):
    """`torch.load(cpu_file, map_location="neuron")`: PyTorch's own path for a PrivateUse1
    device moves each storage with `storage.to(device)`, which needs a C++ allocator and
    crashed the process. Views of one CPU storage load as views of one device buffer."""
    base = torch.arange(12.0)
    sd = {"w": base.reshape(3, 4), "row": base[4:8], "t": base.reshape(3, 4).t(),
          "i": torch.tensor([1, 2], dtype=torch.int64)}
    loaded = torch.load(_saved(sd), map_location=where)
    for k, v in sd.items():
        assert loaded[k].device == torch.device("neuron", 0), k
        assert torch.equal(loaded[k].cpu(), v) and loaded[k].stride() == v.stride(), k
    loaded["w"].add_(100)  # one buffer, as on CPU
    assert torch.equal(loaded["row"].cpu(), base[4:8] + 100)
    assert torch.equal(loaded["t"].cpu(), base.reshape(3, 4).t() + 100)


def test_views_of_a_device_buffer_stay_views_through_save_and_load():
    w = torch.zeros(100, device="neuron")
    for kw in ({}, {"map_location": "cpu"}, {"weights_only": False}):
        # another buffer saved in between (a tied model's state_dict: embed, ..., lm_head):
        # its read made the first host copy look stale, and the views came back as copies
        d = torch.load(_saved({"a": w, "x": torch.ones(3, device="neuron"), "b": w,
                               "v": w[10:20], "m": w.view(10, 10).t()}), **kw)
        d["a"].add_(1)
        assert d["b"][0].item() == 1.0 and d["v"][0].item() == 1.0 and d["m"][0, 0].item() == 1
        assert d["m"].stride() == (1, 10) and d["a"].device.type == kw.get("map_location",
                                                                           "neuron")


def test_pickle_and_the_legacy_format_keep_values_and_views(mode):
    """The legacy format (and plain pickle of a tensor, which `all_gather_object` and
    `broadcast_object_list` use) restores a storage's device before reading its bytes: the
    tensors came back over uninitialized memory, silently."""
    import io
    import pickle
    for dev in ("cpu", "neuron"):
        t = torch.arange(3.).to(dev) + 1
        assert pickle.loads(pickle.dumps(t)).cpu().tolist() == [1.0, 2.0, 3.0]
        buf = io.BytesIO()
        torch.save({"t": t, "v": t[1:]}, buf, _use_new_zipfile_serialization=False)
        buf.seek(0)
        d = torch.load(buf, weights_only=False)
        d["v"].mul_(10)  # still a view of the same storage
        assert d["t"].device.type == dev and d["t"].cpu().tolist() == [1.0, 20.0, 30.0]
        lin = torch.nn.Linear(2, 1).to(dev)
        again = pickle.loads(pickle.dumps(lin))
        assert torch.equal(again.weight.cpu(), lin.weight.cpu()) and again.weight.requires_grad


def test_a_save_sees_the_values_at_its_time():
    """Views share one host copy within a save; a later save after a write reads again."""
    t = torch.zeros(3, device="neuron")
    first = _saved(t)
    t.add_(5)
    second = _saved([t, t[1:]])
    with ae.adaptive():
        t.mul_(2)  # queued, not flushed, when the third save starts
        third = _saved(t[:2])
        u = torch.zeros(2, device="neuron")
        t.add_(1)  # queued: the save's read of u launches it before t's second view
        fourth = _saved([t[:1], u, t])
    assert torch.load(first).tolist() == [0.0] * 3
    assert [x.tolist() for x in torch.load(second)] == [[5.0] * 3, [5.0] * 2]
    assert torch.load(third).tolist() == [10.0] * 2
    assert [x.tolist() for x in torch.load(fourth)] == [[11.0], [0.0] * 2, [11.0] * 3]


def test_deepcopy_copies_a_buffer_once_and_only_leaves():
    base = torch.zeros(4, device="neuron")
    b2, v2 = copy.deepcopy((base, base[2:]))
    b2.add_(1)
    assert v2.tolist() == [1.0, 1.0] and base.tolist() == [0.0] * 4
    x = torch.ones(2, device="neuron", requires_grad=True) * 2
    with pytest.raises(RuntimeError, match="Only Tensors created explicitly by the user"):
        copy.deepcopy(x)
    with pytest.raises(RuntimeError, match="Only Tensors created explicitly by the user"):
        copy.deepcopy(x.cpu())  # CPU's own rule, word for word


def test_a_storage_cannot_move_to_the_device():
    with pytest.raises(RuntimeError, match="A storage cannot be moved to neuron"):
        torch.UntypedStorage(16).to(device="neuron")  # crashed the process before


def test_parameter_round_trips_as_parameter():
    p = torch.nn.Parameter(torch.ones(2, device="neuron"))
    q = torch.load(_saved(p))
    assert isinstance(q, torch.nn.Parameter) and q.requires_grad and q.device.type == "neuron"


def test_torch_load_mmap(tmp_path):
    sd = _tied().to("neuron").state_dict()
    torch.save(sd, tmp_path / "ckpt.pt")
    on_device = torch.load(tmp_path / "ckpt.pt", mmap=True)
    on_host = torch.load(tmp_path / "ckpt.pt", mmap=True, map_location="cpu")
    for k, v in sd.items():
        assert on_device[k].device.type == "neuron" and on_host[k].device.type == "cpu"
        assert torch.equal(on_device[k].cpu(), v.cpu()) and torch.equal(on_host[k], v.cpu())


def test_checkpoint_loads_in_a_process_that_never_imports_the_package(tmp_path):
    x = torch.arange(5.0, device="neuron") * 2
    torch.save({"x": x}, tmp_path / "ckpt.pt")
    code = ("import sys, torch\n"
            f"x = torch.load({str(tmp_path / 'ckpt.pt')!r}, map_location='cpu')['x']\n"
            "assert 'adaptive_eager' not in sys.modules\n"
            "print(x.tolist())\n")
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")  # no backend entry points
    env.pop("PYTHONPATH", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(x.cpu().tolist())


def test_storage_identity_of_views_and_buffers():
    x = torch.arange(6.0, device="neuron").reshape(2, 3)
    y = torch.arange(6.0, device="neuron")
    s = x.untyped_storage()
    assert s.data_ptr() != 0 and s.nbytes() == 24
    assert x[1].untyped_storage().data_ptr() == s.data_ptr()  # a view: same buffer
    assert x[1].data_ptr() == x.data_ptr() + 3 * 4  # offsets add up
    assert y.untyped_storage().data_ptr() != s.data_ptr()


def test_safetensors_save_file_load_file(tmp_path):
    from safetensors.torch import load_file, save_file
    x = torch.arange(6.0, device="neuron").reshape(2, 3)
    save_file({"x": x, "xt": x.t().contiguous()}, tmp_path / "t.safetensors")
    loaded = load_file(tmp_path / "t.safetensors")
    assert torch.equal(loaded["x"], x.cpu()) and torch.equal(loaded["xt"], x.cpu().t())


def test_safetensors_refuses_shared_neuron_tensors_as_on_cpu(tmp_path):
    from safetensors.torch import save_file
    x = torch.arange(6.0, device="neuron")
    with pytest.raises(RuntimeError, match="share memory"):
        save_file({"a": x, "b": x[:3]}, tmp_path / "t.safetensors")


@pytest.mark.xfail(strict=True, reason="safetensors' Rust side accepts a fixed list of device "
                   "names (cpu, cuda, mps, npu, xpu, hpu, ...): 'device neuron is invalid'")
def test_safetensors_load_file_on_neuron(tmp_path):
    from safetensors.torch import load_file, save_file
    save_file({"x": torch.ones(2)}, tmp_path / "t.safetensors")
    assert load_file(tmp_path / "t.safetensors", device="neuron")["x"].device.type == "neuron"


# -- 7. Generators ------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda g: torch.randn(3, device="neuron", generator=g),
    lambda g: torch.rand(3, device="neuron", generator=g),
    lambda g: torch.randperm(4, device="neuron", generator=g),
    lambda g: torch.empty(3, device="neuron").bernoulli_(0.5, generator=g),
    lambda g: torch.multinomial(torch.ones(3, device="neuron"), 2, generator=g),
], ids=["randn", "rand", "randperm", "bernoulli_", "multinomial"])
def test_cpu_generator_is_refused_as_cuda_does(make):
    with pytest.raises(RuntimeError,
                       match="^Expected a 'neuron' device type for generator but found 'cpu'$"):
        make(torch.Generator())


# -- 8. ZeroTensor and sparse ------------------------------------------------------------------
def test_sgn_backward_uses_zero_tensors(mode):
    x = torch.tensor([-1.5, 0.0, 2.0])
    xn = x.to("neuron").requires_grad_()
    x.requires_grad_()
    x.sgn().mul(3).sum().backward()
    xn.sgn().mul(3).sum().backward()
    assert torch.equal(xn.grad.cpu(), x.grad)


def test_efficientzerotensor_is_zeros():
    z = torch._efficientzerotensor((2, 3), dtype=torch.float32, device="neuron")
    assert z.device.type == "neuron" and torch.equal(z.cpu(), torch.zeros(2, 3))


def _bits(t):
    t = t.cpu()  # (CPU's ZeroTensor has no storage to read)
    t = torch.zeros(t.shape, dtype=t.dtype) if t._is_zerotensor() else t
    return repr(t.tolist()), t.signbit().tolist()  # (repr: NaN equals NaN)


@pytest.mark.skipif(not native_loaded(), reason="the ZeroTensor key needs the native hooks")
def test_zero_tensors_skip_arithmetic_as_on_cpu(mode):
    """Note [Zero tensors]: autograd's known-zero tensors are ZeroTensors on the device too:
    0 * inf is 0 and x + 0 keeps -0.0 (materialized zeros gave NaN and +0.0: hessian's forward
    AD at inf, fuzzer seeds 19006231 and 77134), and they refuse writes in CPU's words."""
    inf = float("inf")
    got = {}
    for dev in ("cpu", "neuron"):
        z = torch._efficientzerotensor((3,), device=dev)
        x = torch.tensor([inf, -0.0, 2.0], device=dev)
        hess = torch.func.hessian(lambda u: (u ** 3).sum())(torch.tensor([inf, 2.0], device=dev))
        u = torch.tensor([-0.0, 1.0], device=dev)
        _, tangent = torch.func.jvp(lambda v: v.abs().sgn() * v, (u,), (u,))
        with pytest.raises(RuntimeError, match="ZeroTensors are immutable"):
            torch._efficientzerotensor((2,), device=dev).add_(1)
        got[dev] = (z._is_zerotensor(), (z * x)._is_zerotensor(), _bits(z * x), _bits(x + z),
                    _bits(torch.tensor(-0.0, device=dev) + z), _bits(hess), _bits(tangent))
    assert got["neuron"] == got["cpu"]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("make", [
    lambda: torch.eye(3, device="neuron").to_sparse(),
    lambda: torch.eye(3, device="neuron").to_sparse_csr(),
    lambda: torch.eye(3).to_sparse().to("neuron"),
    lambda: torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]),
                                    (2, 2), device="neuron"),
], ids=["to_sparse", "to_sparse_csr", "cpu-sparse-to", "sparse_coo_tensor"])
def test_sparse_layouts_raise_a_clear_not_implemented_error(make):
    with pytest.raises(NotImplementedError, match="sparse layouts .* not supported on the "
                       "neuron device"):
        make()


# -- found while testing: an error inside a native backward op ------------------------------
# (Note [Device-thread errors] in adaptive_eager/engine/hooks.py: it used to abort the process)
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recomputes_the_same_dropout(mode, reentrant):
    """torch.utils.checkpoint saves the device's RNG state only for a device module that says
    `_initialized`; without it the recomputed dropout drew a new mask (wrong gradients)."""
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).to("neuron")
    x = torch.randn(4, 8, device="neuron")

    def f(x):
        return torch.nn.functional.dropout(lin(x), 0.5, training=True).relu()

    grads = []
    for ckpt in (True, False):
        torch.manual_seed(1)
        xi = x.clone().requires_grad_()
        y = checkpoint(f, xi, use_reentrant=reentrant) if ckpt else f(xi)
        y.sum().backward()
        grads.append(xi.grad.cpu())
    assert grads[0].abs().sum() > 0 and torch.equal(grads[0], grads[1])


def test_packed_sequences_through_an_lstm_as_on_cpu(mode):
    """pack_padded_sequence keeps batch_sizes on the host (PyTorch refuses a PackedSequence
    whose batch_sizes are on a device), and pad_packed_sequence returns host lengths."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 6, num_layers=2, batch_first=True, bidirectional=True)
    x, lengths = torch.randn(3, 5, 4), torch.tensor([5, 3, 2])
    results = []
    for dev in ("cpu", "neuron"):
        m = copy.deepcopy(lstm).to(dev)
        out, (h, _) = m(pack_padded_sequence(x.to(dev), lengths, batch_first=True))
        y, lens = pad_packed_sequence(out, batch_first=True)
        (y.pow(2).sum() + h.sum()).backward()
        results.append((y.detach().cpu(), lens, [p.grad.cpu() for p in m.parameters()]))
    (y0, l0, g0), (y1, l1, g1) = results
    assert l1.device.type == "cpu" and torch.equal(l0, l1)
    assert torch.allclose(y0, y1, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g0, g1))


def test_error_in_backward_reaches_the_caller():
    code = ("import torch, adaptive_eager as ae\n"
            "class Twice(torch.autograd.Function):\n"
            "    forward = staticmethod(lambda ctx, x: x * 2)\n"
            "    backward = staticmethod(lambda ctx, g: torch.ops.aten._test_functorch_fallback("
            "g, g))  # a CPU fallback\n"
            "x = torch.randn(3, 3).to('neuron').requires_grad_()\n"
            "try:\n"
            "    Twice.apply(x).sum().backward()\n"
            "except ae.NeuronFallbackError:\n"
            "    print('raised')\n")
    env = dict(os.environ, NEURON_FALLBACK_ENABLED="0")  # so the fallback raises
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "raised", out.stderr[-500:]


def test_half_and_bfloat16_of_a_module_while_its_graph_is_alive(mode):
    """`model.half()` / `.to(torch.bfloat16)` with an earlier output still in scope (its
    graph holds the parameters): CUDA's `param.data = new` path keeps each Parameter object
    (ties, optimizers); a swap refused ("Couldn't swap LayerNorm.weight")."""
    m = _tied().to("neuron")
    w = m[0].weight
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    out = m(torch.tensor([1, 2], device="neuron"))
    m.half()
    assert m[0].weight is w and m[2].weight is w and w.dtype == torch.float16
    m.to(torch.bfloat16)
    assert w.dtype == torch.bfloat16 and opt.param_groups[0]["params"][0] is w
    assert isinstance(w, torch.nn.Parameter) and w.device.type == "neuron"
    del out


def test_a_default_device_of_neuron(mode):
    """`torch.set_default_device("neuron")` / `with torch.device("neuron"):` makes every
    factory without a device land on neuron, the engine's own host tensors included: printing
    and any host read raised "Could not run 'aten::set_.source_Storage_storage_offset'"."""
    def work():
        torch.manual_seed(0)
        x = torch.randn(4, 3)
        net = torch.nn.Linear(3, 2)
        loss = net(x).relu().sum()
        loss.backward()
        text = repr(x)
        t = torch.empty(2, 3)
        t.resize_(4, 3).fill_(1.0)  # grows the buffer (a host copy)
        out = [loss.item(), bool(loss > 0), x.tolist(), net.weight.grad, t,
               torch.load(_saved({"x": x[1:]}))["x"],  # save/load (host copies)
               torch.ops.aten._test_functorch_fallback(torch.eye(3), torch.eye(3) * 2),  # a CPU
               torch.linalg.det(torch.eye(3) * 2),  # fallback; linear algebra on the device
               torch.nn.init.trunc_normal_(torch.empty(3, 3)), x.cpu().pin_memory()]
        if x.device.type == "neuron":  # CUDA's rule: device memory is never pinned
            with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
                x.pin_memory()
        return text, out
    with torch.device("neuron"):
        text, got = work()
    _, want = work()
    assert text.startswith("tensor([[") and "device='neuron:0'" in text
    assert got[0] == want[0] and got[1] == want[1] and got[2] == want[2]
    for g, w in zip(got[3:], want[3:]):
        assert g.device.type in ("neuron", "cpu") and torch.equal(g.cpu(), w.cpu())


def test_torchscript_onto_the_device_raises_instead_of_loading_empty_weights():
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Linear(4, 3)), buf)
    for where in ("neuron", torch.device("neuron", 0)):
        buf.seek(0)
        with pytest.raises(RuntimeError, match="TorchScript modules cannot be loaded onto"):
            torch.jit.load(buf, map_location=where)
    buf.seek(0)
    assert torch.jit.load(buf, map_location="cpu").weight.shape == (3, 4)


def test_sharing_with_another_process_is_refused_clearly():
    """torch.multiprocessing pickled a neuron tensor as a CPU copy: the child got a CPU
    tensor and its writes were lost without a word. Note [Sharing across processes]."""
    import multiprocessing.reduction as reduction
    t = torch.zeros(3, device="neuron")
    with pytest.raises(RuntimeError, match="cannot be sent to another process.*t.cpu"):
        reduction.ForkingPickler.dumps(t)
    with pytest.raises(RuntimeError, match="cannot be sent to another process"):
        reduction.ForkingPickler.dumps({"batch": [torch.nn.Parameter(t)]})
    assert t.share_memory_() is t and not t.is_shared()  # a no-op, as on CUDA
    s = t.storage()  # CUDA's behaviour: a TypedStorage over the device buffer
    assert s.device == t.device and s.size() == 3
    with pytest.raises(RuntimeError, match="cannot be pickled"):
        reduction.ForkingPickler.dumps(s)
    assert torch.load(_saved(t)).device == t.device  # pickling for a file still works
