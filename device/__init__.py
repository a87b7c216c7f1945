"""The simulated NeuronCore: spec, HBM, hardware queue, clock and trace. Knows nothing of
dispatch or fusion: it runs launches on buffers and accounts for time and memory."""
from .core import Device, DeviceError, DeviceRNG, Launch, LaunchError, with_generator
from .counters import COUNTERS, Counters
from .memory import HBM, HOST_CHECK_BYTES, Buffer, NeuronOutOfMemoryError
from .spec import DeviceSpec

__all__ = ["COUNTERS", "Buffer", "Counters", "Device", "DeviceError", "DeviceRNG", "DeviceSpec",
           "HBM", "HOST_CHECK_BYTES", "Launch", "LaunchError", "NeuronOutOfMemoryError",
           "with_generator"]
