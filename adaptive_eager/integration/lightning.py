"""Lightning on neuron: `Trainer(accelerator="neuron", devices=N)` and `Fabric(accelerator=
"neuron")`, with `lightning` or `pytorch_lightning` / `lightning_fabric`, registered when the user
imports Lightning (never imported here).

Note [Lightning]: Lightning has no discovery for third-party accelerators (its registries are
filled from its own modules; entry points exist only for callbacks), so a finder at the head
of `sys.meta_path` (`patches.after_import`) waits for Lightning's accelerator connector modules
(Trainer's, Fabric's) to be imported and, once one has run, registers `neuron` with that
flavour's accelerator registry.
Lightning then needs six changes that a custom Accelerator cannot make, all made only for
neuron (every other accelerator takes Lightning's own code):
- `accelerator="auto"`: Lightning picks among its own accelerators, so a script written for any
  device trained on the CPU; where Lightning would pick the CPU and neuron is available, it
  picks neuron (TPU, MPS and CUDA keep their precedence), and `devices="auto"` then follows
  Lightning's rule for a GPU (every core, DDP; one core in a notebook).
- one device: Lightning builds `SingleDeviceStrategy(device="cpu")` for any accelerator it does
  not know, so the model trained on the CPU; neuron gets the strategy on its device.
- `precision="16-mixed" / "bf16-mixed"`: Lightning builds CUDA's autocast for any accelerator
  it does not know, which leaves neuron ops alone (silently fp32); neuron gets its own.
- DDP: Lightning builds the DDP wrapper under `torch.cuda.stream(torch.cuda.Stream())` when it
  has device ids; for neuron, under a neuron stream.
- teardown: a module that cannot be moved to the CPU stays on its device (Note [Lightning's
  teardown]).
- BatchSizeFinder: a neuron OOM is an OOM (Note [Lightning's OOM test]).
"""
from __future__ import annotations

import importlib
import typing
import warnings

import torch

from .. import patches

DEVICE_TYPE = "neuron"


class _Flavour(typing.NamedTuple):
    """Where one Lightning flavour keeps what is changed (Note [Lightning])."""
    package: str
    connector: str  # the connector class, in the hooked module
    registry: str  # the accelerator registry, in `package`.accelerators
    user_precision: str  # the connector's field for a precision plugin the user gave
    setup_ddp: str  # the DDPStrategy method that wraps the module
    ddp_ids: str  # the DDPStrategy method that gives its device ids


_TRAINER = dict(connector="_AcceleratorConnector", registry="AcceleratorRegistry",
                user_precision="_precision_plugin_flag", setup_ddp="_setup_model",
                ddp_ids="determine_ddp_device_ids")
_FABRIC = dict(connector="_Connector", registry="ACCELERATOR_REGISTRY",
               user_precision="_precision_instance", setup_ddp="setup_module",
               ddp_ids="_determine_ddp_device_ids")
# the module whose import means "this Lightning is being imported" -> its flavour
_CONNECTORS = {
    "lightning.pytorch.trainer.connectors.accelerator_connector":
        _Flavour("lightning.pytorch", **_TRAINER),
    "pytorch_lightning.trainer.connectors.accelerator_connector":
        _Flavour("pytorch_lightning", **_TRAINER),
    "lightning.fabric.connector": _Flavour("lightning.fabric", **_FABRIC),
    "lightning_fabric.connector": _Flavour("lightning_fabric", **_FABRIC),
}
_registered: set = set()  # hooked module names done


def install() -> None:
    """Register with each Lightning flavour once its connector module has run (at once for
    one already imported)."""
    global _watching
    if not _watching:
        _watching = True
        for name in _CONNECTORS:
            patches.after_import(name, _register)


_watching = False


def _register(connector_module) -> None:
    name = connector_module.__name__
    if name in _registered:
        return
    _registered.add(name)
    flavour = _CONNECTORS[name]
    try:
        _patch(flavour, getattr(connector_module, flavour.connector))
    except Exception as e:  # another Lightning than the one this was written for
        warnings.warn(f"adaptive_eager could not register the 'neuron' accelerator with "
                      f"{flavour.package} ({type(e).__name__}: {e}); accelerator='neuron' is "
                      f"not available there", stacklevel=2)


def _patch(flavour: _Flavour, connector) -> None:
    def part(name):
        return importlib.import_module(f"{flavour.package}.{name}")
    accelerators, strategies = part("accelerators"), part("strategies")
    precision = part("plugins.precision")
    cls = _accelerator_class(accelerators.Accelerator,
                             part("utilities.exceptions").MisconfigurationException)
    registry = getattr(accelerators, flavour.registry)

    def on_neuron(flag) -> bool:
        return flag == DEVICE_TYPE or isinstance(flag, cls)

    choose_auto = connector._choose_auto_accelerator  # a staticmethod

    def _choose_auto_accelerator() -> str:
        chosen = choose_auto()
        return DEVICE_TYPE if chosen == "cpu" and torch.neuron.is_available() else chosen

    choose_strategy = connector._choose_strategy

    def _choose_strategy(self):
        if (on_neuron(self._accelerator_flag) and self._num_nodes_flag == 1
                and len(self._parallel_devices) == 1):
            return strategies.SingleDeviceStrategy(device=self._parallel_devices[0])
        return choose_strategy(self)

    init_precision = connector._check_and_init_precision

    def _check_and_init_precision(self):
        with warnings.catch_warnings():  # CUDA's GradScaler, unavailable, replaced below
            warnings.filterwarnings("ignore", "torch.cuda.amp.GradScaler is enabled")
            plugin = init_precision(self)
        if (on_neuron(self._accelerator_flag) and type(plugin) is precision.MixedPrecision
                and plugin is not getattr(self, flavour.user_precision)
                and plugin.device != DEVICE_TYPE):
            return precision.MixedPrecision(plugin.precision, DEVICE_TYPE)
        return plugin

    patches.patch(connector, "_choose_auto_accelerator", staticmethod(_choose_auto_accelerator),
                  rests_on=f"{flavour.package}'s connector._choose_auto_accelerator (private)")
    patches.patch(connector, "_choose_strategy", _choose_strategy,
                  rests_on=f"{flavour.package}'s connector._choose_strategy (private)")
    patches.patch(connector, "_check_and_init_precision", _check_and_init_precision,
                  rests_on=f"{flavour.package}'s connector._check_and_init_precision (private)")

    ddp = strategies.DDPStrategy
    setup_ddp = getattr(ddp, flavour.setup_ddp)

    def setup_neuron_ddp(self, module):
        if self.root_device.type != DEVICE_TYPE:
            return setup_ddp(self, module)
        device_ids = getattr(self, flavour.ddp_ids)()
        with torch.neuron.stream(torch.neuron.Stream(self.root_device)):
            return torch.nn.parallel.DistributedDataParallel(module=module, device_ids=device_ids,
                                                             **self._ddp_kwargs)
    patches.patch(ddp, flavour.setup_ddp, setup_neuron_ddp,
                  rests_on=f"{flavour.package}'s DDPStrategy.{flavour.setup_ddp} wrapping the "
                           f"module under a CUDA stream")
    strategy = strategies.Strategy
    # Trainer's strategies and tuner (Fabric's strategies hold no module to move)
    if hasattr(strategy, "lightning_module"):
        patches.patch(strategy, "teardown", _teardown_keeping_the_error(strategy.teardown),
                      rests_on=f"{flavour.package}'s Strategy.teardown moving "
                               f"`self._lightning_module` to the CPU")
        memory, scaling = part("utilities.memory"), part("tuner.batch_size_scaling")
        is_oom = _is_oom_error(memory.is_oom_error)
        rests_on = (f"{flavour.package}'s BatchSizeFinder asking is_oom_error (imported by name "
                    f"into tuner.batch_size_scaling)")
        patches.patch(memory, "is_oom_error", is_oom, rests_on=rests_on)
        patches.patch(scaling, "is_oom_error", is_oom, rests_on=rests_on)
    if DEVICE_TYPE not in registry:  # last: a Lightning this cannot change has no neuron
        cls.register_accelerators(registry)


def _teardown_keeping_the_error(teardown):
    """Note [Lightning's teardown]: Trainer's teardown moves the module to the CPU, also while
    the exception that ended `fit` is being raised (`_call_and_handle_interrupt`): a user's
    error in `training_step`, an OOM, Ctrl-C. Its traceback holds the failed step's autograd
    graph, which holds the parameters, so a neuron module cannot be swapped to the CPU (Note
    [Module.to keeps Parameters]; CUDA's `.data =` can): "_apply(): Couldn't swap ..." was
    raised from the teardown in place of the user's error, and Ctrl-C's graceful shutdown
    failed. On neuron, a module that cannot be moved stays whole on its device (Note [A failed
    move moves nothing]), with a warning, and the rest of the teardown runs."""
    def teardown_keeping_the_error(self):
        module = self.lightning_module
        if module is None or not any(p.device.type == DEVICE_TYPE for p in module.parameters()):
            return teardown(self)
        try:
            module.cpu()
        except RuntimeError as e:
            if "Couldn't swap" not in str(e):
                raise
            device = next(p.device for p in module.parameters() if p.device.type == DEVICE_TYPE)
            warnings.warn(f"Lightning's teardown could not move the model to the CPU ({e}: an "
                          f"autograd graph, such as the one of a step that raised, still holds "
                          f"its parameters); it stays on {device}", stacklevel=2)
            self._lightning_module = None  # the teardown without the move
            try:
                return teardown(self)
            finally:
                self._lightning_module = module
        return teardown(self)
    return teardown_keeping_the_error


def _is_oom_error(is_oom_error):
    """Note [Lightning's OOM test]: Lightning's BatchSizeFinder (`Tuner.scale_batch_size`) shrinks
    the batch after an error its `is_oom_error` recognizes: CUDA's by the word "CUDA" in the
    message, or the CPU allocator's, so the first neuron OOM ended the search. A neuron OOM
    (`NeuronOutOfMemoryError`) is recognized too."""
    from device import NeuronOutOfMemoryError

    def is_oom_error_or_neuron(exception: BaseException) -> bool:
        return isinstance(exception, NeuronOutOfMemoryError) or is_oom_error(exception)
    return is_oom_error_or_neuron


def _parse_devices(devices, error) -> list[int]:
    """Lightning's reading of `devices` for a GPU: N (the first N), -1 (all), "0,2" or a list
    (those cores)."""
    count = torch.neuron.device_count()
    given = devices
    if isinstance(devices, str):
        devices = devices.strip()
        if "," in devices:
            devices = [int(d) for d in devices.split(",") if d.strip()]
        else:
            devices = int(devices)
    if isinstance(devices, int):
        if devices == -1:
            return list(range(count))
        if not 0 < devices <= count:
            raise error(f"You requested {given} neuron devices but only {count} are visible "
                        f"(torch.neuron.device_count()).")
        return list(range(devices))
    devices = [int(d) for d in devices]
    bad = [d for d in devices if not 0 <= d < count]
    if bad or len(set(devices)) != len(devices) or not devices:
        raise error(f"Invalid neuron devices {given}: expected distinct indices in "
                    f"[0, {count}) (torch.neuron.device_count() is {count}).")
    return devices


def _accelerator_class(base, error):
    class NeuronAccelerator(base):
        """Lightning's accelerator for the neuron device (adaptive_eager)."""

        def setup_device(self, device: torch.device) -> None:
            if device.type != DEVICE_TYPE:
                raise error(f"Device should be neuron, got {device} instead")
            torch.neuron.set_device(device)

        def get_device_stats(self, device) -> dict:
            return torch.neuron.memory_stats(device)

        def teardown(self) -> None:
            torch.neuron.empty_cache()

        @staticmethod
        def parse_devices(devices) -> list[int]:
            return _parse_devices(devices, error)

        @staticmethod
        def get_parallel_devices(devices) -> list[torch.device]:
            return [torch.device(DEVICE_TYPE, i) for i in devices]

        @staticmethod
        def auto_device_count() -> int:
            return torch.neuron.device_count()

        @staticmethod
        def is_available() -> bool:
            return torch.neuron.is_available()

        @staticmethod
        def name() -> str:
            return DEVICE_TYPE

        @classmethod
        def register_accelerators(cls, accelerator_registry) -> None:
            accelerator_registry.register(DEVICE_TYPE, cls, description=cls.__name__)

    return NeuronAccelerator
