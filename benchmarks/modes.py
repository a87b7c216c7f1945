"""The modes every workload runs in, in the same run."""
import contextlib

import adaptive_eager as ae

# name -> (device, adaptive strategy or None, settings)
MODES = {
    "cpu": ("cpu", None, {}),
    "eager": ("neuron", None, {}),
    "graph": ("neuron", "graph", {}),
    "matmul": ("neuron", "matmul", {}),
    # the compiled-graph bound of our partitioner: purely lazy, no sync inside the step
    "whole-graph": ("neuron", "graph", {"queue_low_threshold": 0}),
    # torch.compile(backend="neuron") around the model (training) or the step (inference),
    # the rest of the step in adaptive `graph` mode (see workloads.compiled)
    "compile": ("neuron", "graph", {}),
}
COMPILED = {"compile"}  # modes whose workloads run through torch.compile


@contextlib.contextmanager
def mode_scope(mode, **extra):
    """The mode as TORCH_NEURONX_ENABLE_CONCATENATION=1 sets it (no dispatch-mode scope)."""
    device, strategy, settings = MODES[mode]
    if device == "cpu":
        yield device
        return
    with ae.override(**settings, **extra):
        ae.set_adaptive(strategy is not None)
        if strategy is not None:
            ae.set_strategy(strategy)
        try:
            yield device
        finally:
            ae.set_adaptive(False)
            ae.set_strategy("graph")
