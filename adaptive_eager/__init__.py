"""adaptive-eager: a `neuron` device for PyTorch on a simulated NeuronCore, with an adaptive
eager mode that queues ops and fuses them (TORCH_NEURONX_ENABLE_CONCATENATION=1).

The package re-exports its public API (api.py); importing it registers the device. Layout:
engine/ (one core's dispatch, queue, replay), integration/ (what teaches torch and libraries
about the device), tools/ (demo, run, report); see README.md beside this file."""
from .api import (  # noqa: F401
    Cost, DeviceSpec, Explanation, FlushInterrupted, NeuronFallbackError, NeuronInductorError,
    NeuronOutOfMemoryError, NeuronRuntimeError, Snapshot, adaptive, config, core_metrics,
    bucketing_collate, explain, is_adaptive, line_report, metrics, metrics_report, native_hooks, override,
    pad_to_bucket, register_cost, reset_metrics, save_trace, set_adaptive, set_device_spec, set_strategy,
    strategy, synchronize, wait_for_compiles)
from .api import __all__, __getattr__  # noqa: F401  (ae.kernels, on first use)

