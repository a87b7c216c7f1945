"""Warnings, errors, out-of-memory, the disk cache across processes, metrics."""
import glob
import json
import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.engine import engine as _engine
from device import DeviceSpec

from tests.harness.fallback import FALLBACK_OP, fallback  # no device implementation


def _forget_warnings():
    _engine.ENGINE.warned.clear()


def test_fallback_warns_once_per_op_and_is_counted(mode):
    _forget_warnings()
    a = torch.randn(3, 3) + 3 * torch.eye(3)
    x = a.to("neuron")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        d1 = torch.ops.aten._test_functorch_fallback(x, x)  # (the user's line)
        d2 = torch.ops.aten._test_functorch_fallback(x * 2, x * 2)
        _ = x.t()  # view ops never warn
    msgs = [str(m.message) for m in w]
    assert msgs.count(f"Operator '{FALLBACK_OP}' fell back to CPU") == 1, msgs
    assert w[0].filename == __file__  # the warning points at the user's line
    torch.testing.assert_close(d1.cpu(), fallback(a))
    torch.testing.assert_close(d2.cpu(), fallback(a * 2))
    m = ae.metrics()
    assert m.cpu_fallbacks == {FALLBACK_OP: 2}
    assert any(k.startswith("fallback:") for k in m.flushes) or mode == "eager"


@torch.library.custom_op("ae_test::plus_one", mutates_args=(), tags=(torch.Tag.pointwise,))
def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@_plus_one.register_fake
def _(x):
    return torch.empty_like(x)


def test_custom_ops_run_on_cpu_whatever_their_tags(mode):
    """A user's custom op (torch.library) is not the device's: it falls back to CPU, even when
    tagged pointwise (which once made it a fusable device op whose executable could not be
    built: BadProgram)."""
    _forget_warnings()
    x = torch.randn(5)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        y = _plus_one(x.to("neuron")) * 2
        torch.testing.assert_close(y.cpu(), (x + 1) * 2)
    assert "Operator 'ae_test::plus_one' fell back to CPU" in [str(m.message) for m in w]
    assert ae.metrics().cpu_fallbacks == {"ae_test::plus_one": 1}


def test_fallback_only_for_unimplemented_raises_when_cpu_recovery_is_off():
    x = torch.randn(3, 3, device="neuron")
    with ae.override(fallback_enabled=False):
        with pytest.raises(ae.NeuronFallbackError, match=FALLBACK_OP[6:]):
            fallback(x)
    assert (x + 1).cpu().shape == (3, 3)  # still usable


def test_float64_warns_once_and_computes_as_float32():
    _forget_warnings()
    a = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        x = a.to("neuron")
        y = x * 3
        z = y + 1
    assert sum("float64" in str(m.message) for m in w) == 1
    assert x.dtype == torch.float64 and z.dtype == torch.float64
    expected = ((a.float() * 3) + 1).double()
    assert torch.equal(z.cpu(), expected)  # float32 arithmetic, stored as float64
    assert torch.equal(x.cpu(), a.float().double())  # rounded to float32 on the way in
    assert not torch.equal(x.cpu(), a)


def test_out_of_memory_names_sizes_and_device_recovers():
    ae.set_device_spec(DeviceSpec(hbm_bytes=1 << 20))
    try:
        a = torch.empty(150_000, device="neuron")  # 600 kB
        with pytest.raises(ae.NeuronOutOfMemoryError) as e:
            torch.empty(150_000, device="neuron")
        assert isinstance(e.value, torch.OutOfMemoryError)
        msg = str(e.value)
        assert "out of memory. Tried to allocate 585.94 KiB" in msg and "in use" in msg and "free" in msg
        with pytest.raises(torch.OutOfMemoryError):
            a * 2  # an op's output does not fit either
        del a
        b = torch.ones(150_000, device="neuron")  # fits after the free
        assert b.sum().item() == 150_000
    finally:
        ae.set_device_spec(DeviceSpec())


def test_out_of_memory_in_adaptive_mode_flushes_freed_values_first():
    ae.set_device_spec(DeviceSpec(hbm_bytes=1 << 20))
    try:
        with ae.adaptive():
            x = torch.ones(50_000, device="neuron")  # 200 kB
            for _ in range(20):  # 20 x 200 kB of intermediates, only one alive at a time
                x = x + 1
            assert x[0].item() == 21
    finally:
        ae.set_device_spec(DeviceSpec())


def test_deferred_error_names_op_and_line_and_device_keeps_working(mode):
    x = torch.randn(4, device="neuron")
    idx = torch.tensor([7], device="neuron")
    y = x.index_select(0, idx); line = sys._getframe().f_lineno  # noqa: E702
    with pytest.raises(ae.NeuronRuntimeError) as e:
        torch.neuron.synchronize()
    msg = str(e.value)
    assert "operation=aten::index_select" in msg
    assert f'{os.path.basename(__file__)}", line {line}' in msg
    z = x + 1  # the device keeps working
    torch.testing.assert_close(z.cpu(), x.cpu() + 1)
    torch.neuron.synchronize()  # the error was reported once
    del y


def test_deferred_error_pickles_for_another_process():
    """A NeuronRuntimeError crosses processes (a worker's error, concurrent.futures): it
    pickles with its message, op, source and notes (unpickling called its __init__ with the
    message alone: a TypeError), here and in a fresh process importing nothing first."""
    x = torch.randn(4, device="neuron")
    x.index_select(0, torch.tensor([7], device="neuron"))
    with pytest.raises(ae.NeuronRuntimeError) as e:
        torch.neuron.synchronize()
    e.value.add_note("a note")
    data = pickle.dumps(e.value)
    back = pickle.loads(data)
    assert type(back) is ae.NeuronRuntimeError and str(back) == str(e.value)
    assert (back.op, back.source, back.__notes__) == (e.value.op, e.value.source, ["a note"])
    code = ("import pickle, sys; e = pickle.loads(sys.stdin.buffer.read()); "
            "print(type(e).__name__, e.op)")
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True,
                         timeout=300)
    assert out.stdout.decode().split() == ["NeuronRuntimeError", "aten::index_select"], \
        out.stderr.decode()[-2000:]


def test_earliest_deferred_error_first():
    x = torch.randn(4, device="neuron")
    x.index_select(0, torch.tensor([9], device="neuron"))
    x.gather(0, torch.tensor([11], device="neuron"))
    with pytest.raises(ae.NeuronRuntimeError, match="index_select"):
        x.sum().item()


def test_launch_blocking_raises_at_the_op():
    x = torch.randn(4, device="neuron")
    idx = torch.tensor([7], device="neuron")
    with ae.override(launch_blocking=True):
        with pytest.raises(ae.NeuronRuntimeError, match="index_select"):
            x.index_select(0, idx)
        assert (x * 2).cpu().shape == (4,)


def test_stack_trace_option_adds_the_python_stack():
    x = torch.randn(4, device="neuron")
    with ae.override(stack_trace=True):
        x.index_select(0, torch.tensor([7], device="neuron"))
    with pytest.raises(ae.NeuronRuntimeError) as e:
        torch.neuron.synchronize()
    assert "test_stack_trace_option_adds_the_python_stack" in str(e.value)


def test_shape_errors_raise_at_the_call_with_torchs_message(mode):
    a, b = torch.randn(2, 3, device="neuron"), torch.randn(4, 5, device="neuron")
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied"):
        a @ b
    with pytest.raises(RuntimeError, match="must match the size"):
        a + b
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a + torch.randn(2, 3)
    assert (a + 1).shape == (2, 3)


def test_eager_launches_equal_ops_executed():
    x = torch.randn(8, 8, device="neuron")
    w = torch.randn(8, 8, device="neuron")
    ae.reset_metrics()
    y = torch.relu(x @ w + 1).sum(0).exp()
    m = ae.metrics()
    assert m.ops == 5 and m.launches == 5, m
    assert m.flushes == {"eager": 5}
    y.cpu()
    assert ae.metrics().d2h_bytes == 32


def test_metrics_fields_and_report():
    x = torch.randn(16, device="neuron")
    (x * 2).cpu()
    m = ae.metrics()
    for field in ("ops", "launches", "flushes", "compiles", "cache_memory_hits",
                  "cache_disk_hits", "cache_misses", "cpu_fallbacks", "h2d_bytes",
                  "d2h_bytes", "device_time_us", "compile_time_us", "peak_memory_bytes"):
        assert hasattr(m, field), field
    assert m.h2d_bytes == 0 and m.d2h_bytes == 64 and m.device_time_us > 0
    text = ae.metrics_report()
    assert "launches" in text and "device time (simulated)" in text


# -- the executable cache on disk ----------------------------------------------------
SCRIPT = textwrap.dedent("""
    import json, warnings, torch, adaptive_eager as ae
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as w:
        x = torch.arange(12.0).view(3, 4).to("neuron")
        y = (torch.relu(x @ x.t() + 1.5) * 0.5).sum(1)
        vals = y.tolist()
    m = ae.metrics()
    print(json.dumps({"vals": vals, "compiles": m.compiles, "disk": m.cache_disk_hits,
                      "warnings": [str(x.message) for x in w]}))
""")


def _run(cache_dir, adaptive=False):
    env = dict(os.environ, TORCH_NEURONX_NEFF_CACHE_DIR=str(cache_dir))
    if adaptive:
        env["TORCH_NEURONX_ENABLE_CONCATENATION"] = "1"
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("adaptive", [False, True], ids=["eager", "adaptive"])
def test_second_process_reuses_disk_cache(tmp_path, adaptive):
    first = _run(tmp_path, adaptive)
    assert first["compiles"] > 0 and first["disk"] == 0
    second = _run(tmp_path, adaptive)
    assert second["compiles"] == 0 and second["disk"] == first["compiles"]
    assert second["vals"] == first["vals"]


def test_corrupt_cache_file_is_survived(tmp_path):
    first = _run(tmp_path)
    files = glob.glob(str(tmp_path / "**" / "*.neff"), recursive=True)
    assert len(files) == first["compiles"]
    with open(files[0], "wb") as f:
        f.write(b"garbage")
    with open(files[1], "r+b") as f:  # a flipped byte in the payload: checksum mismatch
        data = bytearray(f.read())
        data[-3] ^= 0xFF
        f.seek(0)
        f.write(bytes(data))
    second = _run(tmp_path)
    assert second["vals"] == first["vals"]
    assert second["compiles"] == 2
    bad = [w for w in second["warnings"] if "Ignoring executable cache file" in w]
    assert len(bad) == 2
    third = _run(tmp_path)  # the bad files were rewritten
    assert third["compiles"] == 0 and not third["warnings"]


def test_disable_disk_cache(tmp_path):
    env = dict(os.environ, TORCH_NEURONX_NEFF_CACHE_DIR=str(tmp_path),
               TORCH_NEURONX_NEFF_DISABLE_CACHE="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not glob.glob(str(tmp_path / "**" / "*.neff"), recursive=True)


def test_shared_cache_directory_concurrent_writers(tmp_path):
    env = dict(os.environ, TORCH_NEURONX_NEFF_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    results = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert all(r["vals"] == results[0]["vals"] and not r["warnings"] for r in results)
    assert _run(tmp_path)["compiles"] == 0


def test_memory_cache_lru_bound():
    with ae.override(cache_max_entries=5, disable_disk_cache=True):
        x = torch.randn(4, device="neuron")
        for k in range(1, 12):
            x = x.view(-1)[:k].sum() + x if k % 2 else x * k  # new signatures
        cache = _engine.ENGINE.runner.cache
        assert len(cache) <= 5 and ae.metrics().cache_evictions > 0


def test_bad_settings_fail_clearly_and_leave_the_engine_usable():
    with pytest.raises(ValueError, match="unknown fusion strategy 'fastest'"):
        ae.set_strategy("fastest")
    with pytest.raises(ValueError, match="unknown fusion strategy"):
        with ae.adaptive(strategy="fastest"):
            pass
    with pytest.raises(AttributeError, match="no setting named 'adaptiv'"):
        with ae.override(adaptiv=True):
            pass
    assert ae.strategy() == "graph" and not ae.is_adaptive()
    with ae.adaptive():
        assert (torch.ones(2, device="neuron") * 3).tolist() == [3.0, 3.0]


def test_invalid_environment_value_names_the_variable():
    env = dict(os.environ, TORCH_NEURONX_CONCATENATION_BUFFER_SIZE_LIMIT="lots")
    out = subprocess.run([sys.executable, "-c", "import adaptive_eager"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert "TORCH_NEURONX_CONCATENATION_BUFFER_SIZE_LIMIT='lots' is not valid" in out.stderr
    env["TORCH_NEURONX_CONCATENATION_BUFFER_SIZE_LIMIT"] = "0"  # out of range: was taken as 1
    out = subprocess.run([sys.executable, "-c", "import adaptive_eager"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert "TORCH_NEURONX_CONCATENATION_BUFFER_SIZE_LIMIT='0' is not valid: " in out.stderr
    assert "at least 1" in out.stderr


@pytest.mark.parametrize("bad", [dict(max_pending_mb="64"), dict(buffer_size_limit=0),
                                 dict(adaptive="no"), dict(max_group_ops=-1),
                                 dict(max_pending_mb=float("nan")), dict(tier_up=True)])
def test_an_override_of_the_wrong_type_or_out_of_range_names_the_setting(bad):
    """A string where a number was due failed later, inside an op ("unsupported operand type
    for +: 'NeuronTensor' and 'int'"); 0 or -1 was taken as 1; "no" as True."""
    (name, value), = bad.items()
    before = getattr(ae.config, name)
    with pytest.raises(ValueError, match=f"setting {name} .* must be"):
        with ae.override(**bad):
            pass
    assert getattr(ae.config, name) == before
    with ae.adaptive():
        assert (torch.ones(2, device="neuron") + 1).tolist() == [2.0, 2.0]


def test_op_shape_inference_refuses_runs_on_the_device_at_once(mode):
    """A table op whose meta kernel refuses inputs CPU accepts (mse_loss_backward of an empty
    input divides by zero) is no fallback: it runs on the device now, with CPU's result."""
    _forget_warnings()
    x = torch.randn(1, 5, 0).to("neuron").requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        torch.nn.functional.mse_loss(x, torch.zeros(1, 5, 0, device="neuron")).backward()
    assert x.grad.shape == (1, 5, 0)
    assert ae.metrics().cpu_fallbacks == {}


@pytest.mark.parametrize("opt", ["SGD", "Adam", "AdamW"])
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_optimizers_match_cpu(opt, foreach, mode):
    kwargs = {"SGD": dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
              "Adam": dict(lr=1e-2, amsgrad=True), "AdamW": dict(lr=1e-2)}[opt]
    results = []
    for device in ("cpu", "neuron"):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(5, 4).to(device))
        o = getattr(torch.optim, opt)([p], foreach=foreach, **kwargs)
        for _ in range(3):
            (p.sin() * p).sum().backward()
            o.step()
            o.zero_grad()
        results.append(p.detach().cpu())
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)


def test_realtime_mode_spends_the_modeled_time_on_the_wall_clock():
    import time
    x = torch.randn(64, device="neuron")
    (x * 2).cpu()  # compile outside the timed part
    with ae.override(realtime=True):
        before = ae.metrics()
        t0 = time.perf_counter()
        for _ in range(20):
            x = x * 2
        torch.neuron.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    device_us = (ae.metrics() - before).device_time_us
    assert device_us > 0 and wall_us >= device_us  # a lower bound: the spin waits at least that


def test_demo_runs_and_writes_trace_and_graph(tmp_path):
    env = dict(os.environ, TORCH_NEURONX_NEFF_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-m", "adaptive_eager", "demo", "--steps", "2",
                          "--strategy", "all", "--trace", str(tmp_path / "t.json"),
                          "--graph", str(tmp_path / "g.dot")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "adaptive graph" in out.stdout and "adaptive matmul" in out.stdout
    assert "identical in every mode" in out.stdout
    assert "time to steady state" in out.stdout  # issue 28: a sentence per mode
    assert "adaptive graph: steady state from step" in out.stdout or \
        "adaptive graph: compiles did not stop" in out.stdout
    trace = json.load(open(tmp_path / "t.json"))
    assert any(e.get("ph") == "X" and e.get("cat") == "launch" for e in trace["traceEvents"])
    assert open(tmp_path / "g.dot").read().startswith("digraph")


def test_log_level_and_file(tmp_path):
    log = tmp_path / "neuron.log"
    env = dict(os.environ, TORCH_NEURONX_LOG_LEVEL="3", TORCH_NEURONX_LOG_FILE=str(log),
               TORCH_NEURONX_ENABLE_CONCATENATION="1",
               TORCH_NEURONX_CONCATENATION_QUEUE_LOW_THRESHOLD="0",
               TORCH_NEURONX_NEFF_CACHE_DIR=str(tmp_path / "cache"))
    code = ("import torch, adaptive_eager as ae\n"
            "x = torch.randn(4, 4, device='neuron')\n"
            "cm = ae.override(max_group_contractions=1)\n"
            "cm.__enter__()\n"
            "print((x @ x @ x).sum().item())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    text = log.read_text()
    assert "flush (item): 3 ops -> 2 launches, plan built" in text
    assert "boundary before group 1: contraction limit (1)" in text
    assert "compile " in text and "[adaptive_eager" not in out.stderr


def test_cost_model_launch_overhead_bandwidth_and_low_precision_peak():
    spec = DeviceSpec()
    a = torch.randn(512, 512, device="neuron")
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = a.to(dtype)
        x.cpu()
        before = ae.metrics()
        x @ x
        torch.neuron.synchronize()
        times[dtype] = (ae.metrics() - before).device_time_us
    nbytes = 3 * 512 * 512 * 4
    fp32 = spec.launch_overhead_us + max(nbytes / (spec.hbm_bandwidth_gbps * 1e3),
                                         2 * 512 ** 3 / (spec.peak_tflops_fp32 * 1e6))
    assert times[torch.float32] == pytest.approx(fp32)
    assert times[torch.bfloat16] < times[torch.float32]


def _sync_interrupted_at_launch(n, monkeypatch):
    """torch.neuron.synchronize(), with Ctrl-C landing as the flush submits its n-th launch."""
    from device import Device
    submit, seen = Device.submit, []

    def interrupting(self, launch):
        seen.append(launch.name)
        if len(seen) == n:
            raise KeyboardInterrupt
        return submit(self, launch)
    monkeypatch.setattr(Device, "submit", interrupting)
    with pytest.raises(KeyboardInterrupt):
        torch.neuron.synchronize()
    monkeypatch.setattr(Device, "submit", submit)


def test_an_interrupted_flush_loses_no_handle(monkeypatch):
    """Ctrl-C lands in the Python that runs a flush: values it never computed had handles
    with no buffer (AttributeError 'NoneType' has no attribute 'storage' on every later
    read, and on ops reading them). Now: what it computed is readable, the rest raises an
    error saying so, and the engine goes on."""
    x = torch.arange(4.0, device="neuron")
    with ae.override(queue_low_threshold=0), ae.adaptive(strategy="none"):
        a = x + 1
        b = a * 2
        c = b - 3
        d = c.exp()
        _sync_interrupted_at_launch(3, monkeypatch)
        assert a.tolist() == [1.0, 2.0, 3.0, 4.0] and b.tolist() == [2.0, 4.0, 6.0, 8.0]
        for t in (c, d, c + 1):
            with pytest.raises(ae.NeuronRuntimeError, match="KeyboardInterrupt interrupted"):
                t.cpu()
        assert (x * 3).tolist() == [0.0, 3.0, 6.0, 9.0]


def test_an_interrupted_flush_leaves_no_in_place_update_silently_undone(monkeypatch):
    """In-place updates queued after the interrupt point (an optimizer step's `add_`) were
    dropped, and the tensor read its old value with no error; CPU applies every update
    that returned. Now those tensors raise; updates that ran before the interrupt stay."""
    with ae.override(queue_low_threshold=0), ae.adaptive(strategy="none"):
        early, w = torch.zeros(2, device="neuron"), torch.zeros(2, device="neuron")
        ae.synchronize()
        early.add_(1.0)  # launch 1: ran
        early.add_(1.0)  # launch 2: ran
        w.add_(1.0)  # launch 3: interrupted
        w.add_(1.0)
        _sync_interrupted_at_launch(3, monkeypatch)
        assert early.tolist() == [2.0, 2.0]
        with pytest.raises(ae.NeuronRuntimeError, match="updates this tensor in place"):
            w.cpu()
        assert (early * 3).tolist() == [6.0, 6.0]


def test_mode_switches_do_not_reread_the_installed_metadata(monkeypatch):
    """Every reconfigure re-read the package's installed version for the disk-cache salt;
    while pip reinstalled the package beside a running program it read None, and
    `ae.adaptive(strategy=...)` raised a TypeError (fuzzer seed 32000018)."""
    import importlib.metadata
    monkeypatch.setattr(importlib.metadata, "version", lambda name: None)
    with ae.adaptive(strategy="matmul"):
        assert (torch.ones(2, device="neuron") * 2).tolist() == [2.0, 2.0]
    assert ae.strategy() == "graph"


def test_a_failed_op_keeps_no_frame_alive(mode):
    """Meta inference kept the exception it caught in a local: a cycle through its frame
    kept the caller's frames, and their tensors' device memory, until the garbage collector
    ran ("catch the error, free memory, retry smaller" got nothing back; a householder
    orthogonal parametrization failed on its extra references)."""
    import gc

    def step(k):
        big = torch.zeros(256, 256 + k, device="neuron")  # a fresh signature per call
        x = torch.arange(6.0 + k, device="neuron")
        try:
            big @ big
        except RuntimeError:
            pass
        return x[x > 2].sum().item()
    step(0)  # (the first arange imports torch._dynamo, whose import leaves cycles of its own)
    ae.synchronize()
    gc.collect()
    gc.disable()
    try:
        base = torch.neuron.memory_allocated()
        step(1)
        step(2)
        assert torch.neuron.memory_allocated() == base
    finally:
        gc.enable()
    m = torch.nn.Linear(5, 4).to("neuron")
    torch.nn.utils.parametrizations.orthogonal(m, "weight", orthogonal_map="householder",
                                               use_trivialization=False)
    assert m.weight.shape == (4, 5)


# Misused settings are refused and change nothing: five regressions, one test each.

def test_set_device_spec_refuses_a_string():
    """set_device_spec("trn2") installed the string: every later op failed."""
    with pytest.raises(TypeError, match="takes an ae.DeviceSpec"):
        ae.set_device_spec("trn2")
    assert (torch.ones(4, device="neuron") + 1).sum().item() == 8


def test_set_device_spec_refuses_less_hbm_than_in_use():
    """A spec with less HBM than in use made free memory negative."""
    import dataclasses
    x = torch.ones(1024, 1024, device="neuron")
    with pytest.raises(ValueError, match="smaller than the"):
        ae.set_device_spec(dataclasses.replace(ae.DeviceSpec(), hbm_bytes=2**20))
    assert torch.neuron.mem_get_info()[0] >= 0 and (x + 1).sum().item() == 2 * 2**20


@pytest.mark.parametrize("call", [pytest.param(lambda: ae.adaptive("matmul"), id="adaptive"),
                                  pytest.param(lambda: ae.set_adaptive("0"), id="set_adaptive")])
def test_adaptive_mode_switches_refuse_what_is_not_a_bool(call):
    """ae.adaptive("matmul") and set_adaptive("0") turned adaptive mode on."""
    mode = ae.is_adaptive()
    with pytest.raises(TypeError, match="True or False"):
        call()
    assert ae.is_adaptive() == mode


def test_elapsed_time_between_events_of_two_cores_is_refused():
    """Events on two cores gave a difference of two clocks."""
    a, b = torch.neuron.Event(enable_timing=True), torch.neuron.Event(enable_timing=True)
    a.record()
    with torch.neuron.device(1):
        b.record()
    with pytest.raises(ValueError, match="same device"):
        a.elapsed_time(b)


def test_demo_refuses_zero_steps(capsys):
    """demo --steps 0 divided by zero."""
    from adaptive_eager.tools import demo
    with pytest.raises(SystemExit):
        demo.main(["--steps", "0"])
    assert "--steps must be at least 1" in capsys.readouterr().err


def test_a_handler_is_added_before_its_op_first_runs(mode):
    """handlers.handle: an op's route, meta results and traces are made once; a handler added
    after the op ran would not be taken (the replay runs the op without it), so it is refused."""
    from adaptive_eager.engine import handlers
    x = torch.rand(4).to("neuron") + 1
    torch.digamma(x).cpu()
    with pytest.raises(RuntimeError, match="already ran on the neuron device"):
        handlers.handle(torch.ops.aten.digamma.default, lambda *a: None)
    assert torch.ops.aten.digamma.default not in handlers.HANDLERS
