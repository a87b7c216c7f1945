"""`torch.neuron` answers what frameworks ask `torch.cuda` (issue 24; the table is
adaptive_eager/TORCH_NEURON_API.md), each from the simulated device."""
import pytest
import torch

import adaptive_eager as ae

# Called on `torch.<device>` by transformers, accelerate, PEFT, TRL and Lightning on their
# device paths (grep of their sources, `torch.cuda.*` / `torch.neuron.*` / device modules)
FRAMEWORK_CALLS = [
    "is_available", "is_initialized", "device_count", "current_device", "set_device", "device",
    "get_device_name", "get_device_properties", "get_device_capability", "is_bf16_supported",
    "synchronize", "empty_cache", "ipc_collect", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats",
    "reset_max_memory_allocated", "mem_get_info", "memory_stats", "device_memory_used",
    "manual_seed", "manual_seed_all", "get_rng_state", "set_rng_state", "get_rng_state_all",
    "set_rng_state_all", "Stream", "Event", "stream", "StreamContext", "current_stream",
    "default_stream", "is_current_stream_capturing", "OutOfMemoryError",
]


def test_every_call_frameworks_make_is_there():
    missing = [n for n in FRAMEWORK_CALLS if not hasattr(torch.neuron, n)]
    assert missing == []


def test_capability_and_precision():
    assert torch.neuron.is_bf16_supported() and torch.neuron.is_bf16_supported(False)
    assert torch.neuron.is_tf32_supported() is False
    props = torch.neuron.get_device_properties(0)
    assert torch.neuron.get_device_capability() == (props.major, props.minor) == (3, 0)
    with pytest.raises((RuntimeError, ValueError)):
        torch.neuron.get_device_capability(torch.neuron.device_count())  # no such core
    assert torch.neuron.init() is None and torch.neuron.ipc_collect() is None
    assert torch.neuron.is_current_stream_capturing() is False


def test_memory_figures_follow_the_device():
    torch.neuron.synchronize()
    torch.neuron.reset_peak_memory_stats()
    base = torch.neuron.memory_allocated()
    x = torch.ones(1024, device="neuron")
    y = x + 1
    torch.neuron.synchronize()
    assert torch.neuron.device_memory_used() == torch.neuron.memory_allocated() >= base + 8192
    peak = torch.neuron.max_memory_allocated()
    del y
    torch.neuron.synchronize()
    assert torch.neuron.max_memory_allocated() == peak > torch.neuron.memory_allocated()
    torch.neuron.reset_max_memory_allocated()
    assert torch.neuron.max_memory_allocated() == torch.neuron.memory_allocated()
    assert torch.neuron.memory_cached() == torch.neuron.memory_reserved()
    nested = torch.neuron.memory_stats_as_nested_dict()
    stats = torch.neuron.memory_stats()
    assert nested["allocated_bytes"]["all"]["current"] == stats["allocated_bytes.all.current"]
    assert f"{torch.neuron.memory_allocated():,} B" in torch.neuron.memory_summary()
    torch.neuron.reset_accumulated_memory_stats()
    assert torch.neuron.memory_stats()["allocation.all.allocated"] == 0
    del x


def test_out_of_memory_is_caught_as_frameworks_catch_it():
    with pytest.raises(torch.neuron.OutOfMemoryError):
        torch.empty(torch.neuron.mem_get_info()[1] // 4 + 1, device="neuron")
    assert issubclass(torch.neuron.OutOfMemoryError, torch.OutOfMemoryError)


def test_stream_context_and_device_of():
    s = torch.neuron.Stream()
    before = torch.neuron.current_stream()
    with torch.neuron.StreamContext(s) as inside:
        assert inside is s and torch.neuron.current_stream() == s
    assert torch.neuron.current_stream() == before
    if torch.neuron.device_count() > 1:
        assert torch.neuron.can_device_access_peer(0, 1)
        t = torch.ones(1, device="neuron:1")
        with torch.neuron.device_of(t):
            assert torch.neuron.current_device() == 1
        assert torch.neuron.current_device() == 0
    with torch.neuron.device_of(torch.ones(1)):  # a CPU tensor: unchanged
        assert torch.neuron.current_device() == 0


def test_bf16_detection_reaches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.utils import import_utils
    import_utils.is_torch_bf16_gpu_available.cache_clear()
    assert transformers.utils.is_torch_bf16_gpu_available()
    assert ae.metrics() is not None
