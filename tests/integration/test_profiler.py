"""torch.profiler shows the simulated device's launches, compiles and syncs, and agrees with
ae.save_trace."""
import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import adaptive_eager as ae


def _timeline(path):
    ae.save_trace(str(path))
    return [(e["name"], e["cat"], e["dur"]) for e in json.load(open(path))["traceEvents"]
            if e["ph"] == "X" and e["pid"] == 0]  # neuron:0's row (an earlier test may
    # have left another core's engine: its events follow core 0's in the file)


def _work():
    x = torch.randn(48, 40).to("neuron")
    w = torch.randn(40, 24).to("neuron")
    return torch.nn.functional.gelu(x @ w + 1).sum().item()


@pytest.fixture
def fresh_compiles():
    with ae.override(disable_disk_cache=True, cache_max_entries=1):
        ae.reset_metrics()  # the override made a new cache: count from its counters
        yield


def test_launch_compile_and_sync_events_carry_simulated_durations(tmp_path, fresh_compiles):
    ae.set_adaptive(True)
    _timeline(tmp_path / "before.json")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _work()
    m = ae.metrics()
    avg = {e.key: e for e in prof.key_averages()}
    launches = {k: e for k, e in avg.items() if k.startswith("neuron::")
                and not k.startswith(("neuron::compile:", "neuron::sync:", "neuron::h2d",
                                      "neuron::d2h"))}
    assert len(launches) == 1  # x @ w + 1, gelu, sum: one fused executable
    (name, launch), = launches.items()
    assert "mm" in name and "gelu" in name and "|" in name
    assert launch.count == 1 and launch.device_time_total > 0
    compiles = [e for k, e in avg.items() if k.startswith("neuron::compile:")]
    assert sum(e.cpu_time_total for e in compiles) == pytest.approx(m.compile_time_us)
    assert "neuron::sync:item" in avg
    assert avg["neuron::h2d"].count == 2
    # the same events, durations and order as the device timeline of ae.save_trace
    timeline = _timeline(tmp_path / "after.json")
    assert (name[len("neuron::"):], "launch", pytest.approx(launch.device_time_total)) in \
        [(n, c, pytest.approx(d)) for n, c, d in timeline]


def test_chrome_trace_tells_the_same_story_as_save_trace(tmp_path):
    ae.set_adaptive(True)
    ae.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _work()
        _work()
    prof.export_chrome_trace(str(tmp_path / "prof.json"))
    events = json.load(open(tmp_path / "prof.json"))["traceEvents"]
    mine = [(e["name"], e["dur"]) for e in events
            if e.get("pid") == "neuron:0 (simulated)" and e.get("ph") == "X"]
    # the window's events are the timeline's newest, before save_trace's own sync ("trace")
    timeline = _timeline(tmp_path / "t1.json")
    assert timeline[-1][:2] == ("trace", "sync")
    window = timeline[-len(mine) - 1:-1]

    def named(n, c):
        return f"neuron::{c}:{n}" if c in ("compile", "sync") else f"neuron::{n}"
    assert mine == [(named(n, c), d) for n, c, d in window]
    kinds = {c for _, c, _ in window}
    assert {"launch", "dma", "sync"} <= kinds
    assert any(e.get("name", "").startswith("aten::") for e in events)  # host events kept


def test_events_found_when_the_bounded_timeline_is_full():
    ae.set_adaptive(True)
    dev = ae.engine.engine.ENGINE.device
    for i in range(dev.trace.maxlen):  # a long-running process: the oldest events are gone
        dev.mark(f"filler{i}", "sync", 0.0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _work()
    names = [e.key for e in prof.key_averages() if e.key.startswith("neuron::")]
    assert "neuron::sync:item" in names and not any("filler" in n for n in names)


def test_profiling_cpu_only_code_is_unchanged():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.randn(8).sin()
    assert not [e for e in prof.key_averages() if e.key.startswith("neuron::")]
    prof.key_averages().table()


def test_every_core_shows_its_launches(tmp_path):
    """A profile of work on neuron:1 shows its launches (it showed neuron:0's alone)."""
    ae.set_adaptive(True)
    ae.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        x = torch.randn(48, 40).to("neuron:1")
        torch.nn.functional.gelu(x @ x.T + 1).sum().item()
        torch.randn(8).to("neuron").sin().sum().item()
    devs = {(e.device_type, e.device_index) for e in prof.events()
            if e.key.startswith("neuron::") and e.device_type != torch.autograd.DeviceType.CPU}
    assert {(torch.autograd.DeviceType.PrivateUse1, 0),
            (torch.autograd.DeviceType.PrivateUse1, 1)} <= devs
    prof.export_chrome_trace(str(tmp_path / "prof.json"))
    pids = {e.get("pid") for e in json.load(open(tmp_path / "prof.json"))["traceEvents"]
            if e.get("ph") == "X" and "neuron" in str(e.get("pid"))}
    assert pids == {"neuron:0 (simulated)", "neuron:1 (simulated)"}
    assert "neuron::" in prof.key_averages().table()
