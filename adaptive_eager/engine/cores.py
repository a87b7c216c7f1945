"""Which NeuronCores a process sees, and the current one.

Note [Cores]: the simulated chip has `DeviceSpec.chip_cores` logical cores (4 by default);
NEURON_RT_VISIBLE_CORES / NEURON_RT_NUM_CORES restrict what a process sees, numbered
neuron:0..n-1 as the Neuron runtime does, and `device_count()` reports that. Each core has
its own engine (`_engine.core(k)`: queue, meta and executable caches) and its own simulated
device (hardware queue, clock, HBM share, RNG), made on first use; one lock serializes them
all (Note [Threads]). A tensor's ops go to its core's engine; an op mixing cores raises
CUDA's error; a copy between cores is a costed DMA on each side (transfer.py).

PyTorch's Python device guard for PrivateUse1 (torch/csrc/acc/Module.cpp) reports one device,
and autograd sizes its per-device worker threads from it: a backward on neuron:1 would fail an
internal assert there. Backward runs with autograd's multithreading off (`torch.autograd.
set_multithreading_enabled(False)`, public API; also for CPU's order of a double backward):
the whole backward runs on the calling thread, every core included (registration.py).
The current core (`torch.neuron.set_device`, `torch.neuron.device(k)`) is per thread as CUDA's
with the native hooks (Note [Native hooks] in integration/native.py: the C++ device guard holds
it), per process without them.
"""
from __future__ import annotations

import torch

from . import engine as _engine


def count() -> int:
    """How many NeuronCores this process sees (the chip's, or NEURON_RT_* restrictions)."""
    return _engine.visible_cores()


def current() -> int:
    return _engine.current_index()


def set_current(device) -> None:
    _engine.set_current(check(device))


def check(device) -> int:
    """The core index `device` names (None, or "neuron" with no index: the current one), if
    this process sees that core."""
    if device is None:
        return current()
    if isinstance(device, (str, torch.device)) and torch.device(device).type != "neuron":
        raise ValueError(f"expected a neuron device, got {device!r}")
    idx = device if isinstance(device, int) else torch.device(device).index
    if idx is None:
        return current()
    return _engine.check_core(idx)


def engines() -> list:
    """The engines made so far (core 0 and every core used since)."""
    return list(_engine.ENGINES)


def engine(device=None):
    """The engine of the core `device` names (checked)."""
    return _engine.core(check(device))
