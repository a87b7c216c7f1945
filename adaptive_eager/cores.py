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
the whole backward runs on the calling thread, every core included (_registration.py).
The current core (`torch.neuron.set_device`, `torch.neuron.device(k)`) is per process, not per
thread as CUDA's is.
"""
from __future__ import annotations

import torch

from . import _engine


def count() -> int:
    """How many NeuronCores this process sees (the chip's, or NEURON_RT_* restrictions)."""
    return _engine.visible_cores()


def current() -> int:
    return _engine._CURRENT[0]


def set_current(device) -> None:
    k = check(device)
    if k:
        _route_unindexed()
    _engine.set_current(k)


# Note [Unindexed devices]: "neuron" with no index means the current core. PyTorch's C++
# resolves it through the device guard, which for a Python backend always answers core 0:
# after `torch.neuron.set_device(1)`, `.to("neuron")` (and Module.to) landed on neuron:0
# (factories such as torch.empty come to us unresolved and were right). Once a core other
# than 0 is made current, Tensor.to names the core. `torch.tensor(..., device="neuron")`
# still lands on neuron:0 (README, Known gaps).
_ROUTED = []


def _named(device):
    """`device` with the current core's index if it is "neuron" with none."""
    if isinstance(device, (str, torch.device)):
        d = torch.device(device)
        if d.type == "neuron" and d.index is None:
            return torch.device("neuron", current())
    return device


def _route_unindexed() -> None:
    if _ROUTED:
        return
    _ROUTED.append(True)
    to = torch.Tensor.to

    def to_named(self, *args, **kwargs):
        if args:
            args = (_named(args[0]),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _named(kwargs["device"])
        return to(self, *args, **kwargs)
    to_named.__doc__ = to.__doc__
    torch.Tensor.to = to_named  # (Dynamo calls tensor methods by name: compiled code is
    # unchanged; wrapping torch.tensor too would put our code inside traced frames)


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
