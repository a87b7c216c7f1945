"""The neuron device as users touch it: registration, factories, copies, views, module API."""
import copy
import subprocess
import sys
import warnings

import pytest
import torch

import adaptive_eager as ae


def test_device_registered_and_cuda_like_module():
    assert torch._C._get_privateuse1_backend_name() == "neuron"
    assert torch.neuron.is_available() and torch.neuron.device_count() == 4  # one chip
    assert torch.neuron.current_device() == 0
    torch.neuron.set_device(0)
    with pytest.raises(RuntimeError, match="neuron:4 does not exist"):
        torch.neuron.set_device(4)
    with pytest.raises(RuntimeError, match="neuron:4 does not exist"):
        torch.ones(2).to("neuron:4")
    with pytest.raises(RuntimeError, match="neuron:4 does not exist"):
        torch.zeros(2, device="neuron:4")
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator().type == "neuron"
    x = torch.ones(2).neuron()
    assert x.is_neuron and x.device == torch.device("neuron:0")
    assert torch.nn.Linear(2, 2).neuron().weight.is_neuron


def test_plain_import_torch_registers_through_entry_point():
    code = "import torch; print(torch.ones(2, device='neuron').device)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "neuron:0"


def test_autoload_off_is_honoured():
    code = "import torch; print(torch._C._get_privateuse1_backend_name())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "privateuseone"


def test_privateuse1_taken_by_another_backend_fails_clearly():
    code = ("import torch; torch.utils.rename_privateuse1_backend('other');"
            "import adaptive_eager")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PATH": ""})
    assert out.returncode != 0
    assert "already belongs to the backend 'other'" in out.stderr


FACTORIES = {
    "empty": lambda d: torch.empty(2, 3, device=d).shape,
    "zeros": lambda d: torch.zeros(2, 3, device=d),
    "ones": lambda d: torch.ones(2, 3, dtype=torch.int32, device=d),
    "full": lambda d: torch.full((2, 3), 7.5, device=d),
    "arange": lambda d: torch.arange(2, 11, 3, device=d),
    "linspace": lambda d: torch.linspace(0, 1, 5, device=d),
    "eye": lambda d: torch.eye(3, 4, device=d),
    "tensor": lambda d: torch.tensor([[1, 2], [3, 4]], device=d),
    "rand": lambda d: (torch.manual_seed(3), torch.rand(4, device=d))[1],
    "randn": lambda d: (torch.manual_seed(3), torch.randn(4, device=d))[1],
    "randint": lambda d: (torch.manual_seed(3), torch.randint(0, 9, (6,), device=d))[1],
    "randperm": lambda d: (torch.manual_seed(3), torch.randperm(6, device=d))[1],
    "zeros_like": lambda d: torch.zeros_like(torch.ones(3, device=d)),
    "ones_like": lambda d: torch.ones_like(torch.ones(3, device=d)),
    "full_like": lambda d: torch.full_like(torch.ones(3, device=d), 2.0),
    "randn_like": lambda d: (torch.manual_seed(3), torch.randn_like(torch.ones(3, device=d)))[1],
}


@pytest.mark.parametrize("name", FACTORIES)
def test_factories_match_cpu(name, mode):
    cpu, neu = FACTORIES[name]("cpu"), FACTORIES[name]("neuron")
    if isinstance(cpu, torch.Tensor):
        assert neu.device.type == "neuron" and neu.dtype == cpu.dtype
        torch.testing.assert_close(neu.cpu(), cpu, rtol=0, atol=0)
    else:
        assert cpu == neu


def test_copies_and_dtype_conversions(mode):
    a = torch.randn(3, 4)
    x = a.to("neuron", non_blocking=True)
    assert torch.equal(x.cpu(), a) and torch.equal(x.to("cpu"), a)
    y = x.to(torch.float16)
    assert y.dtype == torch.float16 and torch.equal(y.cpu(), a.half())
    z = torch.empty(3, 4, device="neuron")
    z.copy_(x)  # neuron -> neuron
    assert torch.equal(z.cpu(), a)
    out = torch.empty(3, 4)
    out.copy_(x)  # neuron -> cpu
    assert torch.equal(out, a)
    z.copy_(torch.ones(4))  # cpu -> neuron, broadcast
    assert torch.equal(z.cpu(), torch.ones(3, 4))
    assert torch.equal(x.int().cpu(), a.int())


def test_views_share_buffer_and_inplace_is_visible(mode):
    c = torch.arange(24.0).view(4, 6)
    x = c.clone().to("neuron")
    for t in (c, x):
        t[0].add_(1)
        t.t().mul_(2)
        t.view(-1)[::2].zero_()
        t[1:3, 2:5] += 10
        t.select(1, 4).fill_(-1)
        t.narrow(0, 3, 1).sub_(t[0:1])
    assert torch.equal(x.cpu(), c)
    d = x.detach()
    d.add_(1)  # detach shares the buffer
    assert torch.equal(x.cpu(), c + 1)


def test_inplace_through_view_of_pending_tensor(mode):
    a = torch.randn(4, 5)
    x = a.to("neuron") * 2  # pending in adaptive mode
    ca = a * 2
    x[0].add_(1), ca[0].add_(1)
    x.t().mul_(2), ca.t().mul_(2)
    x.view(-1)[::2].zero_(), ca.view(-1)[::2].zero_()
    assert torch.equal(x.cpu(), ca)


def test_version_counter_catches_inplace_on_saved_tensor(mode):
    x = torch.randn(3, device="neuron", requires_grad=True)
    y = x.exp()
    y.add_(1)  # exp saves its output for backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_numpy_raises_like_cuda():
    x = torch.ones(2, device="neuron")
    with pytest.raises(TypeError, match="can't convert neuron:0 device type tensor to numpy"):
        x.numpy()
    assert x.cpu().numpy().tolist() == [1.0, 1.0]


def test_repr_shows_values_and_device():
    x = torch.tensor([1.5, 2.0], device="neuron")
    assert repr(x) == "tensor([1.5000, 2.0000], device='neuron:0')"
    h = torch.tensor([1, 2], dtype=torch.float16, device="neuron")
    assert repr(h) == "tensor([1., 2.], device='neuron:0', dtype=torch.float16)"
    r = torch.ones(2, device="neuron", requires_grad=True)
    assert repr(r) == "tensor([1., 1.], device='neuron:0', requires_grad=True)"
    assert repr(r * 2) == "tensor([2., 2.], device='neuron:0', grad_fn=<MulBackward0>)"
    assert repr(torch.empty(0, 3, device="neuron")) == "tensor([], device='neuron:0', size=(0, 3))"
    assert f"{torch.tensor(2.5, device='neuron'):.2f}" == "2.50"
    assert str(x) == repr(x)


def test_scalar_reads(mode):
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0]], device="neuron")
    assert x.sum().item() == 6.0
    assert bool((x > 0).any()) and not bool((x > 10).any())
    assert int(x[1, 1]) == 4 and float(x[0, 1]) == -2.0
    assert x.tolist() == [[1.0, -2.0], [3.0, 4.0]]
    if (x < 0).any():
        hit = True
    assert hit


def test_random_ops_that_run_at_once_draw_from_the_device_stream(mode):
    """binomial and Dirichlet sampling (no meta kernel: they run at once, not queued) drew
    from the CPU's generator: other values than CPU under one seed, and the device's stream
    did not move (the next draw differed too). Beta, Dirichlet and Binomial sample with them."""
    def draw(d):
        torch.manual_seed(0)
        torch.rand(7, device=d)
        a = torch._sample_dirichlet(torch.ones(3, 2, device=d))
        b = torch.binomial(torch.full((3,), 5.0, device=d), torch.full((3,), 0.5, device=d))
        c = torch.distributions.Beta(torch.ones(2, device=d), torch.ones(2, device=d)).sample()
        return a, b, c, torch.rand(3, device=d)
    for n, c in zip(draw("neuron"), draw("cpu")):
        assert n.device.type == "neuron" and torch.equal(n.cpu(), c)


def test_seeded_random_is_reproducible(mode):
    torch.neuron.manual_seed(5)
    a = torch.randn(8, device="neuron")
    state = torch.neuron.get_rng_state()
    b = torch.rand(8, device="neuron")
    torch.neuron.set_rng_state(state)
    b2 = torch.rand(8, device="neuron")
    torch.manual_seed(5)
    a2 = torch.randn(8, device="neuron")
    assert torch.equal(a.cpu(), a2.cpu()) and torch.equal(b.cpu(), b2.cpu())
    assert torch.neuron.initial_seed() == 5


def test_deepcopy_and_pickle_roundtrip(tmp_path):
    x = torch.randn(3, device="neuron", requires_grad=True)
    y = copy.deepcopy(x)
    assert y.is_neuron and y.requires_grad and torch.equal(y.cpu(), x.cpu())
    y.data.add_(1)
    assert not torch.equal(y.cpu(), x.cpu())
    torch.save({"w": x.detach()}, tmp_path / "t.pt")
    z = torch.load(tmp_path / "t.pt", weights_only=False)["w"]
    assert z.is_neuron and torch.equal(z.cpu(), x.detach().cpu())


def test_memory_stats_and_streams_events():
    torch.neuron.synchronize()
    base = torch.neuron.memory_allocated()
    x = torch.empty(1000, device="neuron")
    assert torch.neuron.memory_allocated() == base + 4000
    assert torch.neuron.max_memory_allocated() >= base + 4000
    del x
    assert torch.neuron.memory_allocated() == base
    torch.neuron.reset_peak_memory_stats()
    assert torch.neuron.max_memory_allocated() == base
    assert torch.neuron.memory_stats()["allocated_bytes.all.current"] == base
    s = torch.neuron.Stream()
    start = torch.neuron.Event(enable_timing=True)
    end = torch.neuron.Event(enable_timing=True)
    a = torch.randn(64, 64, device="neuron")
    start.record()
    with torch.neuron.stream(s):
        assert torch.neuron.current_stream() == s
        b = a @ a
    end.record()
    end.synchronize()
    assert end.query() and s.query()
    assert end.elapsed_time(start) < 0 < start.elapsed_time(end)
    s.wait_event(end)
    s.synchronize()
    assert torch.neuron.current_stream() == torch.neuron.default_stream()
    assert torch.equal(b.cpu(), a.cpu() @ a.cpu())


def test_autocast_runs_matmuls_in_bf16(mode):
    a = torch.randn(4, 8, device="neuron")
    w = torch.randn(8, 8, device="neuron", requires_grad=True)
    with torch.autocast("neuron"):
        y = torch.nn.functional.linear(a, w)
        z = (a + 1) @ w
        loss = y.float().sum()
    assert y.dtype == z.dtype == torch.bfloat16 and (a + 1).dtype == torch.float32
    loss.backward()
    assert w.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.nn.functional.linear(a.cpu(), w.detach().cpu())
    assert torch.equal(y.cpu(), ref)


@pytest.mark.parametrize("cache", [True, False])
def test_autocast_caches_a_weights_cast_within_the_region(mode, cache):
    """Note [Autocast cast cache]: a training loop inside one autocast region keeps using the
    weights' first low-precision copies on CPU and CUDA (C++'s cached_cast); with no cache,
    neuron's losses moved after each step while CPU's stayed put."""
    from torch.utils._python_dispatch import _disable_current_modes

    def train(dev):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 1)).to(dev)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x, y = torch.randn(16, 8).to(dev), torch.randn(16, 1).to(dev)
        losses = []
        with torch.autocast(dev, dtype=torch.bfloat16, cache_enabled=cache):
            for _ in range(3):
                loss = torch.nn.functional.mse_loss(m(x).float(), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        return losses
    with _disable_current_modes():
        want = train("cpu")
    assert train("neuron") == want
    assert (want[0] == want[2]) == cache


def test_gradscalers_float64_warning_says_how_to_silence_it():
    """GradScaler's unscale_ computes in float64 itself: the warning's only advice was "Use
    float32", which the user cannot follow; the filter it now names silences it."""
    import warnings

    from adaptive_eager.engine import engine as _engine
    m = torch.nn.Linear(4, 4).to("neuron")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("neuron")

    def step():
        with torch.autocast("neuron", dtype=torch.float16):
            loss = m(torch.randn(2, 4, device="neuron")).float().sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    _engine.ENGINE.warned.discard("f64")
    with pytest.warns(UserWarning, match="filterwarnings.'ignore', 'float64 is not supported'"):
        step()
    _engine.ENGINE.warned.discard("f64")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "float64 is not supported")
        step()


def test_autocast_follows_cudas_policy(mode):
    """torch.autocast(device_type="neuron") gives the dtypes CUDA's autocast gives (the
    lists of ATen/autocast_mode.h): losses, norms, softmax and sums in float32, attention and
    RNN cells in the low dtype, mixed inputs promoted, float64 untouched, BCE refused. Losses
    were bfloat16 and attention float32 before (only a lower-precision list was kept)."""
    import torch.nn.functional as F
    torch.manual_seed(0)
    x, w = torch.randn(16, 8), torch.randn(8, 10)
    y = torch.randint(0, 10, (16,))
    q = torch.randn(1, 2, 4, 8)
    lstm = torch.nn.LSTM(8, 6, batch_first=True)
    lstm_n = torch.nn.LSTM(8, 6, batch_first=True).to("neuron")
    lstm_n.load_state_dict(lstm.state_dict())
    n = {k: v.to("neuron") for k, v in dict(x=x, w=w, y=y, q=q).items()}
    with torch.autocast("neuron"):
        logits = n["x"] @ n["w"]
        got = {
            "logits": logits, "ce": F.cross_entropy(logits, n["y"]),
            "mse": F.mse_loss(logits, logits.detach().float()),
            "softmax": logits.softmax(-1), "layer_norm": F.layer_norm(logits, (10,)),
            "sum": logits.sum(), "exp": logits.exp(),
            "sdpa": F.scaled_dot_product_attention(n["q"], n["q"], n["q"]),
            "lstm": lstm_n(n["x"].view(2, 8, 8))[0],
            "addcmul": torch.addcmul(n["x"], logits[:, :8], logits[:, :8]),
            "f64": F.linear(n["x"].double(), n["w"].t().double()),
        }
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(logits.sigmoid(), torch.rand(16, 10, device="neuron"))
        with pytest.raises(RuntimeError, match="Unexpected floating ScalarType"):
            torch.addcmul(n["x"].half(), logits[:, :8], logits[:, :8])  # CUDA refuses too
    low, f32 = torch.bfloat16, torch.float32
    want = {"logits": low, "ce": f32, "mse": f32, "softmax": f32, "layer_norm": f32,
            "sum": f32, "exp": f32, "sdpa": low, "lstm": low, "addcmul": f32,
            "f64": torch.float64}
    assert {k: v.dtype for k, v in got.items()} == want
    with torch.autocast("cpu", dtype=torch.bfloat16):  # where CPU's policy is CUDA's too
        ref_logits = x @ w
        ref = {"logits": ref_logits, "ce": F.cross_entropy(ref_logits, y),
               "sdpa": F.scaled_dot_product_attention(q, q, q)}
    for k, v in ref.items():
        torch.testing.assert_close(got[k].cpu(), v, rtol=1e-2, atol=1e-2)
    assert torch.equal(got["logits"].cpu(), ref["logits"])


def test_device_generic_accelerator_api():
    """torch.accelerator (device-generic code: examples, Accelerate) syncs and reads memory
    through C++ hooks a Python backend cannot give: it is routed to torch.neuron's own."""
    import adaptive_eager as ae
    assert torch.accelerator.current_accelerator().type == "neuron"
    torch.neuron.synchronize()
    base = torch.accelerator.memory_allocated()
    x = torch.ones(1000, device="neuron")
    assert torch.accelerator.memory_allocated(0) == base + 4000
    assert torch.accelerator.max_memory_allocated() >= base + 4000
    free, total = torch.accelerator.get_memory_info()
    assert total == torch.neuron.mem_get_info()[1] and free <= total - 4000
    with ae.adaptive():
        bad = x.index_select(0, torch.tensor([5000], device="neuron"))  # a deferred error
        with pytest.raises(ae.NeuronRuntimeError, match="index_select"):
            torch.accelerator.synchronize()  # a sync point, as torch.neuron.synchronize()
    del bad, x
    torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats()
    assert torch.accelerator.max_memory_allocated() == torch.accelerator.memory_allocated()
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        torch.accelerator.synchronize("cuda:0")


@pytest.mark.parametrize("make", [
    lambda: torch.ones(2**17, 1, device="neuron") * torch.ones(1, 2**16, device="neuron"),
    lambda: torch.ones(1, device="neuron").expand(2**33).contiguous(),
    lambda: torch.arange(2**33, dtype=torch.float32, device="neuron")])
def test_a_huge_output_of_small_inputs_is_the_devices_oom_before_any_host_work(mode, make):
    """A 32 GiB output of tiny inputs (a broadcast, an expand, a host-made factory) was built
    on the host first (CPU's probe, the factory's host run): CPU's allocator error, not the
    device's out-of-memory error, or the host's RAM filled before the device said no."""
    with pytest.raises(torch.OutOfMemoryError):
        make()
        torch.neuron.synchronize()
    assert (torch.ones(3, device="neuron") + 1).cpu().tolist() == [2.0, 2.0, 2.0]


def test_an_allocation_the_host_cannot_back_is_the_devices_oom_not_a_kill(monkeypatch):
    """The simulated HBM lives in host RAM: past what the host can give, the process would be
    killed by the OOM killer (everything lost). A large allocation is refused first."""
    import device.memory
    import adaptive_eager as ae
    monkeypatch.setattr(device.memory, "host_available", lambda: (1 << 30) + (128 << 20))
    with ae.adaptive():
        x = torch.ones(16, 1024, 1024, device="neuron")  # 64 MiB: fits
        with pytest.raises(torch.OutOfMemoryError, match="host's RAM"):
            torch.ones(64, 1024, 1024, device="neuron") * 2  # 256 MiB: past the 1 GiB margin
        with pytest.raises(ae.NeuronOutOfMemoryError, match="host's RAM"):
            torch.empty(64, 1024, 1024, device="neuron")
        assert (x[0, 0, :2] + 1).cpu().tolist() == [2.0, 2.0]  # still usable
    monkeypatch.setattr(device.memory, "host_available", lambda: None)  # unknown: no check
    del x
    assert torch.empty(64, 1024, 1024, device="neuron").shape[0] == 64


def test_grad_scaler_skips_an_inf_step_and_scales_back(mode):
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2).to("neuron")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("neuron", init_scale=2.0 ** 8)
    x = torch.randn(3, 4, device="neuron")
    before = [p.detach().clone() for p in net.parameters()]
    with torch.autocast("neuron", dtype=torch.float16):
        loss = net(x).float().sum() * float("inf")  # an overflowing step
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 7
    assert all(torch.equal(p.cpu(), b.cpu()) for p, b in zip(net.parameters(), before))
    opt.zero_grad()
    with torch.autocast("neuron", dtype=torch.float16):
        loss = net(x).float().sum()
    scaler.scale(loss).backward()
    grads = [p.grad.cpu() / scaler.get_scale() for p in net.parameters()]
    scaler.step(opt)
    scaler.update()
    for p, b, g in zip(net.parameters(), before, grads):
        torch.testing.assert_close(p.cpu(), b.cpu() - 0.1 * g)


def test_grad_scaler_is_cpus_on_the_device(mode):
    """fp16 autocast with GradScaler (Lightning's `precision="16-mixed"`), an overflowing step
    among them: losses, scales and parameters are CPU's bit for bit, and its unscale and update
    ops run on the device (they fell back to the CPU, two fallbacks per step)."""
    def train(dev):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                  torch.nn.Linear(16, 4)).to(dev)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(dev, init_scale=2.0 ** 16, growth_interval=2)
        g, seen = torch.Generator().manual_seed(1), []
        for i in range(5):
            x = torch.randn(4, 8, generator=g).to(dev) * (1e30 if i == 2 else 1)
            with torch.autocast(dev, dtype=torch.float16):
                loss = net(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            seen.append((repr(loss.item()), scaler.get_scale()))
        return seen, [p.detach().cpu() for p in net.parameters()]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "float64 is not supported")
        got, got_params = train("neuron")
    with ae.adaptive(False):
        want, want_params = train("cpu")
    assert got == want and got[2][0] == "nan" and got[2][1] < got[1][1]
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params))
    assert ae.metrics().cpu_fallbacks == {}


def test_a_host_gradient_for_a_device_output_is_refused_as_cuda_does(mode):
    """backward()/autograd.grad from a CPU gradient: CUDA raises (autograd's device check
    skips tensor subclasses, so neuron left `.grad` on the CPU, to fail later in step())."""
    x = torch.nn.Parameter(torch.ones(3, device="neuron"))
    with pytest.raises(RuntimeError, match="invalid gradient at index 0 - expected device "
                                           "neuron:0 but got cpu"):
        (x * 2 + 1).backward(torch.ones(3))
    with pytest.raises(RuntimeError, match="invalid gradient at index 0"):
        torch.autograd.grad(x * 3, x, torch.ones(3))
    (x * 2).sum().backward(torch.tensor(1.0))  # a 0-d gradient is moved, as on CUDA
    assert x.grad.device == x.device and x.grad.tolist() == [2.0] * 3


def test_a_device_gradient_for_a_host_output_is_refused_as_cuda_does(mode):
    """A neuron gradient for a CPU output failed autograd's internal stream assert
    ("opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED")."""
    x = torch.randn(5, device="neuron", requires_grad=True)
    with pytest.raises(RuntimeError, match="invalid gradient at index 0 - expected device "
                                           "cpu but got neuron:0"):
        torch.autograd.grad([x.to("cpu")], [x], [torch.ones(5, device="neuron")])
    y = torch.ones(3, requires_grad=True)
    g, = torch.autograd.grad([(y * 2).sum()], [y], [torch.tensor(1.0, device="neuron")])
    assert g.device.type == "cpu" and g.tolist() == [2.0] * 3  # a 0-d one is moved


def test_get_device_properties_as_cuda_scripts_read_it():
    p = torch.neuron.get_device_properties(0)
    assert p.total_memory == torch.neuron.mem_get_info(0)[1] and p.name and p.type == "neuron"
    # (another core's: tests/engine/test_cores.py, which leaves the process one core again)
    with pytest.raises(RuntimeError, match="neuron:9 does not exist"):
        torch.neuron.get_device_properties(9)


@pytest.mark.parametrize("bad", [dict(max_in_flight=0), dict(hbm_bandwidth_gbps=0),
                                 dict(hbm_bandwidth_gbps="fast"), dict(chip_cores=0),
                                 dict(launch_overhead_us=-1.0), dict(peak_tflops_bf16=float("nan"))])
def test_a_device_spec_the_cost_model_cannot_use_is_refused_naming_the_field(bad):
    """DeviceSpec took anything: a zero bandwidth was a ZeroDivisionError and
    max_in_flight=0 an IndexError at the next op."""
    from device.spec import DeviceSpec
    (name, _), = bad.items()
    with pytest.raises(ValueError, match=f"DeviceSpec.{name} must be a number"):
        DeviceSpec(**bad)


def test_record_stream_with_every_neuron_stream(mode):
    """Note [Streams] in neuron.py: `x.record_stream(s)` raised ("unknown parameter type" for a
    torch.neuron.Stream; a CPU fallback that failed for the accelerator's current stream).
    DDP calls it on every input it copies to the device (distributed.utils._recursive_to)."""
    from torch.distributed.utils import _recursive_to
    x = torch.arange(6.0).to("neuron") * 2  # queued in adaptive mode
    streams = [torch.accelerator.current_stream(), torch.neuron.current_stream(),
               torch.neuron.default_stream(), torch.neuron.Stream(),
               torch.neuron.Stream(device=1, priority=-1), torch.Stream(0)]
    before = ae.metrics()
    for s in streams:
        assert x.record_stream(s) is None
    m = ae.metrics() - before
    assert m.cpu_fallbacks == {} and m.flushes == {}  # nothing to record: no boundary
    assert x.cpu().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    with pytest.raises(RuntimeError, match="expected a neuron stream"):
        x.record_stream(torch.Stream(stream_id=0, device_index=0, device_type=0))
    (y,), = _recursive_to((torch.ones(3),), torch.device("neuron:0"), True)  # DDP's copy
    assert y.device == torch.device("neuron:0") and y.cpu().tolist() == [1.0] * 3
    assert ae.metrics().cpu_fallbacks == {}


def test_record_stream_under_no_dispatch(mode):
    """FSDP1 frees its unsharded flat parameter after `record_stream` under `no_dispatch()`
    (fsdp._common_utils._no_dispatch_record_stream), past the Python key: PyTorch raised
    "Could not run 'aten::record_stream' with arguments from the 'neuron' backend" from
    FSDP1's post-backward hook. The PrivateUse1 kernel does what the Python one does."""
    from torch.distributed.fsdp._common_utils import _no_dispatch_record_stream
    from torch.utils._mode_utils import no_dispatch
    x = torch.arange(4.0).to("neuron") + 1
    before = ae.metrics()
    _no_dispatch_record_stream(x, torch.neuron.current_stream())
    with no_dispatch():
        assert x.record_stream(torch.neuron.Stream()) is None
        with pytest.raises(RuntimeError, match="expected a neuron stream"):
            x.record_stream(torch.Stream(stream_id=0, device_index=0, device_type=0))
    m = ae.metrics() - before
    assert m.cpu_fallbacks == {} and m.flushes == {}
    assert x.cpu().tolist() == [1.0, 2.0, 3.0, 4.0]


def test_a_neuron_stream_is_a_torch_stream():
    """torch.accelerator's stream API reaches torch.neuron's (the C++ device guard of a Python
    backend has one stream, of neuron:0)."""
    s = torch.neuron.Stream(device=1)
    assert isinstance(s, torch.Stream) and s.device == torch.device("neuron:1")
    assert torch.accelerator.current_stream(1) == torch.neuron.default_stream(1)
    with s:  # torch.Stream's own context: here torch.neuron.stream(s)
        assert torch.accelerator.current_stream(1) is s and torch.neuron.current_device() == 1
    assert torch.neuron.current_device() == 0 and torch.neuron.current_stream(1).stream_id == 0
    torch.accelerator.set_stream(s)
    try:
        assert torch.neuron.current_stream(1) is s and torch.neuron.current_stream(0).stream_id == 0
    finally:
        torch.accelerator.set_stream(torch.neuron.default_stream(1))
    assert torch.neuron.current_stream(1) == torch.neuron.default_stream(1)
