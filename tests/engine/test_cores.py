"""NeuronCores a process sees (NEURON_RT_VISIBLE_CORES / NEURON_RT_NUM_CORES) and several of
them in one process (Note [Cores] in adaptive_eager/integration/neuron.py)."""
import json
import subprocess
import sys

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.config import Config, _core_list
from tests.harness.fallback import fallback

N = "neuron"


@pytest.fixture(autouse=True)
def _back_to_one_core():
    """Tests here use cores 1..3; later tests in the session see one core again (backward
    then runs on autograd's device thread, as a one-core process does)."""
    yield
    ae.synchronize()
    del ae.engine.engine.ENGINES[1:]
    ae.engine.engine.set_current(0)
    ae.engine.engine._OTHER_CORES_USED[0] = False


def test_core_list_forms():
    assert _core_list("0-1") == (0, 1)
    assert _core_list("2") == (2,)
    assert _core_list("0,3") == (0, 3)
    assert _core_list("0-1,3") == (0, 1, 3)
    assert _core_list("") is None


def test_default_is_one_chip():
    assert torch.neuron.device_count() == ae.engine.engine.ENGINE.spec.chip_cores == 4
    assert torch.accelerator.device_count() == 4


@pytest.mark.parametrize("setting,count", [({"visible_cores": (0, 1)}, 2),
                                           ({"visible_cores": (2,)}, 1),
                                           ({"visible_cores": (0, 3)}, 2),
                                           ({"num_cores": 3}, 3),
                                           ({"visible_cores": (1,), "num_cores": 3}, 1)])
def test_runtime_variables_restrict_the_count(setting, count):
    with ae.override(**setting):
        assert torch.neuron.device_count() == count


def test_cores_the_chip_lacks_are_refused():
    with ae.override(visible_cores=(4,)), pytest.raises(RuntimeError, match="NEURON_RT_VISIBLE"):
        torch.neuron.device_count()
    with ae.override(num_cores=9), pytest.raises(RuntimeError, match="NEURON_RT_NUM_CORES=9"):
        torch.neuron.device_count()


def test_a_core_named_twice_or_a_falling_range_is_refused():
    with ae.override(visible_cores=(0, 0)), pytest.raises(RuntimeError, match=r"\[0\] more "):
        torch.neuron.device_count()
    with pytest.raises(ValueError, match="NEURON_RT_VISIBLE_CORES='1-0' is not valid.*goes down"):
        Config.from_env({"NEURON_RT_VISIBLE_CORES": "1-0"})
    assert Config.from_env({"NEURON_RT_VISIBLE_CORES": "0-1,3"}).visible_cores == (0, 1, 3)


def test_env_is_read_at_start_up():
    code = "import torch, adaptive_eager; print(torch.neuron.device_count())"
    for env, want in (({"NEURON_RT_VISIBLE_CORES": "0-1"}, "2"),
                      ({"NEURON_RT_NUM_CORES": "1"}, "1")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**__import__("os").environ, **env}, timeout=120)
        assert out.stdout.strip() == want, out.stderr


def test_a_core_the_process_does_not_see_is_refused():
    with ae.override(visible_cores=(1,)), pytest.raises(RuntimeError, match="neuron:1 does not"):
        torch.ones(2).to("neuron:1")
    with pytest.raises(RuntimeError, match=r"neuron:4 does not exist.*neuron:0\.\.3"):
        torch.zeros(2, device="neuron:4")
    with pytest.raises(RuntimeError, match="neuron:7 does not"):
        torch.neuron.set_device(7)
    x = torch.ones(2, device="neuron:0")
    assert x.device == torch.device("neuron:0")
    with pytest.raises(RuntimeError, match="neuron:4 does not exist"):
        x.to("neuron:4")  # from a core to one the process lacks (was a phantom core)
    with pytest.raises(RuntimeError, match="neuron:4 does not exist"):
        torch.nn.Linear(2, 2).to("neuron").to("neuron:4")


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_tensors_live_on_their_core_and_compute_cpus_values(mode):
    a = torch.randn(4, 3)
    with ae.adaptive(mode != "eager"):
        xs = [a.to(f"neuron:{k}") for k in range(4)]
        ys = [(x * 2).sin() + torch.ones(3, device=x.device) for x in xs]
        for k, y in enumerate(ys):
            assert y.device == y.untyped_storage().device == torch.device(N, k)
            torch.testing.assert_close(y.cpu(), (a * 2).sin() + 1, rtol=0, atol=0)


def test_an_op_mixing_cores_raises_cudas_error():
    x, y = torch.ones(2, device="neuron:0"), torch.ones(2, device="neuron:1")
    with pytest.raises(RuntimeError, match=r"Expected all tensors to be on the same device, "
                       r"but found at least two devices, neuron:0 and neuron:1!"):
        x + y
    assert (x + 1).cpu().tolist() == [2.0, 2.0]  # both cores keep working
    assert (y + 2).cpu().tolist() == [3.0, 3.0]


def test_core_to_core_copy_is_a_costed_dma_on_each_side():
    a = torch.randn(64, 64)
    x = a.to("neuron:0")
    ae.synchronize()
    ae.reset_metrics()
    y = x.to("neuron:2")
    z = torch.empty(64, 64, device="neuron:1").copy_(x)
    assert y.device == torch.device(N, 2) and z.device == torch.device(N, 1)
    assert torch.equal(y.cpu(), a) and torch.equal(z.cpu(), a)
    assert ae.metrics().d2d_bytes == 2 * a.numel() * 4
    assert ae.core_metrics(0)["dmas"] >= 2  # out of core 0, twice
    assert ae.core_metrics(1)["dmas"] >= 1 and ae.core_metrics(2)["dmas"] >= 1
    h = x.to("neuron:3", dtype=torch.float16)  # a cast on the way, as .to does
    assert h.dtype == torch.float16 and torch.equal(h.cpu(), a.half())


def test_each_core_has_its_own_queue_clock_and_memory():
    ae.synchronize()
    ae.reset_metrics()
    used = [torch.neuron.memory_allocated(k) for k in range(4)]
    for k in range(4):
        torch.neuron.reset_peak_memory_stats(k)
    x = torch.randn(256, 256, device="neuron:1")
    for _ in range(5):
        x = x @ x / 256
    ae.synchronize()
    assert torch.neuron.memory_allocated(1) > used[1]
    assert torch.neuron.memory_allocated(0) == used[0]
    per = [ae.core_metrics(k) for k in range(4)]
    assert per[1]["launches"] >= 5 and per[0]["launches"] == 0
    assert per[1]["device_time_us"] > 0 and per[0]["device_time_us"] == 0
    total = ae.metrics()
    assert sum(p["launches"] for p in per) == total.launches  # the totals add up
    assert abs(sum(p["device_time_us"] for p in per) - total.device_time_us) < 1e-6
    # memory: in use summed over the cores, the peak the largest core's (was core 0's alone)
    assert total.memory_bytes == sum(torch.neuron.memory_allocated(k) for k in range(4))
    assert total.peak_memory_bytes == max(p["peak_memory_bytes"] for p in per)
    assert total.peak_memory_bytes >= per[1]["peak_memory_bytes"] > per[0]["peak_memory_bytes"]


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_training_on_another_core_matches_cpu(mode):
    """Backward on neuron:k (autograd's device threads know one device: it runs on the
    calling thread, Note [Cores])."""
    def train(device):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
        m = m.to(device)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
            loss = torch.nn.functional.mse_loss(m(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, m
    cpu, _ = train("cpu")
    with ae.adaptive(mode != "eager"):
        got, m = train("neuron:2")
    assert all(p.device == torch.device(N, 2) and p.grad.device == p.device
               for p in m.parameters())
    torch.testing.assert_close(got, cpu, rtol=1e-5, atol=1e-6)


def test_current_core_is_where_neuron_without_an_index_goes():
    assert torch.neuron.current_device() == 0
    with torch.neuron.device(3):
        assert torch.neuron.current_device() == 3
        assert torch.empty(2, device=N).device == torch.device(N, 3)
        # `.to("neuron")` from the CPU asks PyTorch's device guard: the native hooks answer
        # the current core; without them PyTorch's Python guard says neuron:0
        # (adaptive_eager/LIMITS.md; tests/integration/test_native.py)
        assert torch.ones(2).to(N).device == torch.device(N, 3 if ae.native_hooks() else 0)
        assert torch.ones(2).to(torch.neuron.current_device()).device == torch.device(N, 3)
    assert torch.neuron.current_device() == 0
    torch.neuron.set_device(1)
    assert torch.zeros(1, device=N).device == torch.device(N, 1)
    torch.neuron.set_device("neuron:0")
    assert torch.zeros(1, device=N).device == torch.device(N, 0)


def test_explain_and_trace_are_per_core(tmp_path):
    (torch.ones(8, device="neuron:1") * 2 + 1).sum().item()
    (torch.ones(8, device="neuron:0") - 1).cpu()
    assert [g["name"] for g in ae.explain(1).groups] == ["sum"]  # its last flush (eager)
    assert [g["name"] for g in ae.explain(0).groups] == ["sub.Tensor"]
    ae.save_trace(str(tmp_path / "t.json"))
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    pids = {e["pid"] for e in events if e.get("ph") == "X"}
    assert {0, 1} <= pids
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names[1] == "NeuronCore 1"


def test_seeding_reaches_cores_used_later_and_keeps_one_core_processes_threaded():
    torch.manual_seed(7)
    assert not ae.engine.engine.other_cores_used()  # seeding alone touches no other core
    x = torch.randn(4, device="neuron:3")  # a core first used after the seed
    torch.manual_seed(7)
    assert torch.equal(x.cpu(), torch.randn(4))  # the device streams equal CPU's
    assert ae.engine.engine.other_cores_used()


def test_every_way_to_make_a_tensor_lands_on_the_named_core():
    import io
    import warnings
    x = torch.arange(4.).to("neuron:1")
    made = [torch.arange(3, device="neuron:2"), torch.eye(2, device="neuron:3"),
            torch.tensor([1, 2], device="neuron:2"), x.new_zeros(3), torch.zeros_like(x),
            x.clone(), x[1:], x.nonzero()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CPU fallback, with its warning
        made.append(fallback(torch.eye(3, device="neuron:1")))
    assert [t.device.index for t in made] == [2, 3, 2, 1, 1, 1, 1, 1, 1]
    buf = io.BytesIO()
    torch.save({"x": x}, buf)
    buf.seek(0)
    y = torch.load(buf)["x"]  # a checkpoint comes back on the core it was saved from
    assert y.device == torch.device(N, 1) and torch.equal(y.cpu(), torch.arange(4.))


def test_deferred_error_in_a_single_threaded_backward_is_raised_not_an_abort():
    """Once a second core is used, backward runs on the caller's thread (Note [Cores]): a
    deferred error surfacing inside a backward node is handed over there too (Note
    [Device-thread errors]); raising through the device guard aborted the process."""
    code = """if True:
        import warnings, torch, torch.nn.functional as F, adaptive_eager as ae
        warnings.simplefilter("ignore")
        torch.zeros(1, device="neuron:1")  # a second core: backward runs single-threaded
        v3 = torch.arange(4, device="neuron").float().requires_grad_()
        v7 = F.multilabel_margin_loss(v3.clamp(min=1e-3, max=0.5)[None],
                                      torch.tensor([[1, -1, 0, 0]], device="neuron"))
        torch.arange(4, device="neuron").gather(0, torch.tensor([-3], device="neuron"))
        try:  # multilabel_margin_loss_backward runs at once (LIMITS): a sync inside backward
            v7.backward()
        except ae.NeuronRuntimeError as e:
            print("raised", "gather" in str(e))
        print("alive", (v3 * 2).sum().item())
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["raised", "True", "alive", "12.0"]


def test_get_device_properties_of_another_core():
    p = torch.neuron.get_device_properties("neuron:1")
    assert p.total_memory == torch.neuron.get_device_properties(0).total_memory


def test_accelerator_device_index_api_follows_the_current_core():
    """torch.accelerator.set_device_index / device_index did nothing (PyTorch asks the C++
    guard, which a Python backend cannot answer), and its memory calls read core 0."""
    torch.accelerator.set_device_index(2)
    assert torch.neuron.current_device() == 2 == torch.accelerator.current_device_index()
    x = torch.zeros(250, device=N)
    assert x.device == torch.device("neuron:2")
    assert torch.accelerator.memory_allocated() == torch.neuron.memory_allocated(2) >= 1000
    with torch.accelerator.device_index(3):
        assert torch.zeros(1, device=N).device == torch.device("neuron:3")
    assert torch.accelerator.current_device_index() == 2
    torch.accelerator.synchronize()


def test_a_streams_repr_names_its_core():
    assert "device=neuron:1 " in repr(torch.neuron.Stream(device=1))  # said neuron:0


def test_new_tensor_lands_on_its_tensors_core():
    """PyTorch places `x.new_tensor(...)` through the C++ device guard set to x's device,
    which a Python backend's guard ignores: a neuron:1 tensor's landed on neuron:0."""
    x = torch.ones(2, device="neuron:1")
    assert x.new_tensor([1.0, 2.0]).device == torch.device("neuron:1")
    assert x.new_tensor([1.0], device="neuron").device == torch.device("neuron:1")
    assert x.new_tensor([1.0], device="neuron:0").device == torch.device("neuron:0")
    assert x.new_tensor([1.0], device="cpu").device == torch.device("cpu")


def test_an_ops_engine_is_its_first_neuron_tensors_in_tree_flatten_order(monkeypatch):
    """engine_of (the core an op runs on) walks positional lists of tensors without
    flattening (a foreach op's), with tree_flatten's answer: the first neuron tensor."""
    from torch.utils._pytree import tree_flatten
    from adaptive_eager.engine import tensor
    from adaptive_eager.engine.tensor import NeuronTensor, engine_of
    a, b = torch.ones(2, device="neuron:0"), torch.ones(2, device="neuron:1")
    c = torch.ones(2)
    cases = [((a, b), {}), ((b, a), {}), (([b, a], [a]), {}), ((1.0, [c, b], a), {}),
             (([c], (c, 2), [a, b]), {}), (([c, [b]], a), {}), (([c], {"x": b}, a), {}),
             (([], [b, a]), {}), (([c],), {"other": a}), (((c, (a,)), b), {})]
    for args, kwargs in cases:
        first = next(t for t in tree_flatten((args, kwargs))[0] if type(t) is NeuronTensor)
        assert engine_of(args, kwargs) is first._engine, (args, kwargs)
    flattened = []
    monkeypatch.setattr(tensor, "tree_flatten", lambda t: flattened.append(t) or tree_flatten(t))
    for args in (([a, b], [b], 0.5), (1.0, (c, b), [a]), ([c, c], [c], a)):
        assert engine_of(args, {}) is next(t for t in tree_flatten(args)[0]
                                           if type(t) is NeuronTensor)._engine
    assert flattened == []  # (the foreach ops' host time: Note [Handled replay])
    # a foreach op across cores: CUDA's error, naming the first list's core
    with pytest.raises(RuntimeError, match="neuron:1"):
        torch._foreach_add_([b], [a])
