"""Frameworks find `neuron` as they find the reference: through its import name.

Note [Frameworks find the device]: Hugging Face Transformers (`is_torch_neuron_available`, which
`TrainingArguments.device` asks) and accelerate (`is_neuron_available`, which `Accelerator()`,
`PartialState` and the launcher ask) pick the neuron device when
`importlib.util.find_spec("torch_neuronx")` finds a module and `torch.neuron.is_available()`;
TRL and PEFT go through those two. Nothing else of the module is read: the only other use is
`import torch_neuronx` in their `check_device=True` path (transformers, accelerate 1.15). The
reference is a pip package of that name; we never install files under it (on a machine with
the real package, pip would overwrite them or they would shadow it). Instead a finder
appended to `sys.meta_path` when the device registers answers for `torch_neuronx` only when
every finder before it (the path finder among them: a real install) found nothing, with a
module built from `compat` below. `ADAPTIVE_EAGER_FRAMEWORKS=0` (setting `frameworks`) turns
the answer off, for users who want these frameworks on the CPU; it is read at each lookup,
and the frameworks cache their answer for the process (`functools.lru_cache`).

Note [Trainer's RNG state]: Transformers' Trainer saves, in each checkpoint, the RNG states of
the devices it knows by name (CPU, CUDA, NPU, HPU, MLU, MUSA, XLA: `_save_rng_state`) and
restores them at `resume_from_checkpoint` (`_load_rng_state`); it has no neuron branch, so a
resumed run with dropout drew other masks than the uninterrupted one (on CUDA the two are the
same run). Once `transformers.trainer` is imported, both methods are wrapped: beside Trainer's
own file, the checkpoint gets every core's neuron RNG state (`torch.neuron.get_rng_state_all`,
one file per process as Trainer names its own), restored after Trainer's own when present.
Only a Trainer on the neuron device (`args.device`) writes it.

Frameworks load only when the user imports them: nothing here imports one.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

from .. import patches
from ..config import DEVICE_TYPE, config

NAME = "torch_neuronx"


class _Compat:
    """What `import torch_neuronx` gives where the real package is absent: the reference's
    module-level names the frameworks or users touch (streams and events, the device
    module's state functions), each ours, and a flag saying it is a simulation."""

    @staticmethod
    def names() -> dict:
        import torch
        from . import neuron
        from importlib.metadata import PackageNotFoundError, version
        try:
            ours = version("adaptive-eager")
        except PackageNotFoundError:
            ours = "0+unknown"
        return {
            "__doc__": "adaptive-eager's stand-in for the reference's `torch_neuronx` (a "
                       "simulated NeuronCore; see adaptive_eager/frameworks.py). The real "
                       "package, when installed, is found first.",
            "__version__": ours,
            "SIMULATED": True,
            "Stream": neuron.Stream, "Event": neuron.Event,
            "synchronize": neuron.synchronize, "device_count": neuron.device_count,
            "is_available": neuron.is_available, "current_device": neuron.current_device,
            "set_device": neuron.set_device,
            "neuron": torch.neuron,
        }


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None  # a plain module object

    def exec_module(self, module):
        module.__dict__.update(_Compat.names())


class Finder(importlib.abc.MetaPathFinder):
    """Answers for `torch_neuronx` alone, and only as the last finder (a real package is
    found by the path finder before it is asked)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME or not config.frameworks:
            return None
        later = sys.meta_path[sys.meta_path.index(self) + 1:] if self in sys.meta_path else []
        for finder in later:  # appended after us (an editable install's finder): theirs
            find = getattr(finder, "find_spec", None)
            if find is not None and find(fullname, path, target) is not None:
                return None
        return importlib.machinery.ModuleSpec(NAME, _Loader(), origin="adaptive-eager")

    def invalidate_caches(self):
        pass


def install() -> None:
    """Append the finder once, and wait for Trainer (registration calls this)."""
    if not any(isinstance(f, Finder) for f in sys.meta_path):
        sys.meta_path.append(Finder())
        patches.after_import("transformers.trainer", _keep_neuron_rng)


def _keep_neuron_rng(module) -> None:
    """Note [Trainer's RNG state]."""
    trainer = getattr(module, "Trainer", None)
    if trainer is None or not hasattr(trainer, "_save_rng_state"):
        return  # another Transformers than the one this was written for
    rests_on = "Trainer's private checkpoint methods (`(self, output_dir)`, `(self, checkpoint)`)"
    patches.patch(trainer, "_save_rng_state", wrap=_saving, rests_on=rests_on)
    patches.patch(trainer, "_load_rng_state", wrap=_loading, rests_on=rests_on)


def _rng_file(trainer, directory: str) -> str:
    args = trainer.args
    name = "neuron_rng_state.pth" if args.world_size <= 1 else \
        f"neuron_rng_state_{args.process_index}.pth"  # (Trainer's own naming)
    return os.path.join(directory, name)


def _saving(save):
    def _save_rng_state(self, output_dir, *args, **kwargs):
        save(self, output_dir, *args, **kwargs)
        if self.args.device.type == DEVICE_TYPE:
            import torch
            torch.save(torch.neuron.get_rng_state_all(), _rng_file(self, output_dir))
    return _save_rng_state


def _loading(load):
    def _load_rng_state(self, checkpoint, *args, **kwargs):
        load(self, checkpoint, *args, **kwargs)
        if checkpoint is None or not os.path.isfile(_rng_file(self, checkpoint)):
            return
        import torch
        torch.neuron.set_rng_state_all(torch.load(_rng_file(self, checkpoint), weights_only=True))
    return _load_rng_state
