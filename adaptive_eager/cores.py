"""Which NeuronCores a process sees, and which of them it can use.

Note [One core per process]: the simulated chip has `DeviceSpec.chip_cores` logical cores;
NEURON_RT_VISIBLE_CORES / NEURON_RT_NUM_CORES restrict what a process sees, numbered
neuron:0..n-1 as the Neuron runtime does, and `device_count()` reports that. The engine
still simulates one core per process (one queue, one HBM, one clock), always `neuron:0`:
a tensor on `neuron:1` cannot work from pure Python, because PyTorch's Python PrivateUse1
device guard (torch/csrc/acc/Module.cpp, PythonDeviceGuard) fixes `deviceCount()` at 1 and
`getDevice()` at 0, and autograd sizes its per-device ready queues from it (a backward on
neuron:1 fails an internal assert in autograd's engine). So `neuron:k` for k > 0 is refused
with that reason; a process that should run on core k is given it the runtime's way,
NEURON_RT_VISIBLE_CORES=k, and sees it as neuron:0.
"""
from __future__ import annotations

import torch

from . import _engine
from .config import config


def count() -> int:
    """How many NeuronCores this process sees (the chip's, or NEURON_RT_* restrictions)."""
    chip = _engine.ENGINE.spec.chip_cores
    if config.visible_cores is not None:
        bad = [c for c in config.visible_cores if not 0 <= c < chip]
        if bad or not config.visible_cores:
            raise RuntimeError(f"NEURON_RT_VISIBLE_CORES={config.visible_cores} names cores "
                               f"the chip does not have: it has {chip} (0..{chip - 1})")
        return len(config.visible_cores)
    if config.num_cores is not None:
        if not 0 < config.num_cores <= chip:
            raise RuntimeError(f"NEURON_RT_NUM_CORES={config.num_cores} but the chip has "
                               f"{chip} NeuronCores")
        return config.num_cores
    return chip


def check(device) -> int:
    """The core index `device` names (None: the current one), if this process can use it."""
    if device is None:
        return 0
    if isinstance(device, (str, torch.device)) and torch.device(device).type != "neuron":
        raise ValueError(f"expected a neuron device, got {device!r}")
    idx = device if isinstance(device, int) else torch.device(device).index
    if not idx:
        return 0
    n = count()
    if not 0 <= idx < n:
        raise RuntimeError(f"neuron:{idx} does not exist: this process sees {n} NeuronCore"
                           f"{'s' if n != 1 else ''} (neuron:0..{n - 1}; see "
                           f"NEURON_RT_VISIBLE_CORES / NEURON_RT_NUM_CORES)")
    raise RuntimeError(
        f"neuron:{idx} cannot be used: this simulation runs one NeuronCore per process, "
        f"neuron:0 (PyTorch's Python device guard for PrivateUse1 reports a single device, "
        f"so autograd cannot run on neuron:{idx}). Give each process its core the Neuron "
        f"runtime's way, NEURON_RT_VISIBLE_CORES={idx} (it then sees it as neuron:0), and use "
        f"neuron:0 in every rank.")
