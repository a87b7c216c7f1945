"""NeuronCores a process sees (NEURON_RT_VISIBLE_CORES / NEURON_RT_NUM_CORES) and the one
it can use (Note [One core per process] in adaptive_eager/cores.py)."""
import subprocess
import sys

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.config import _core_list


def test_core_list_forms():
    assert _core_list("0-1") == (0, 1)
    assert _core_list("2") == (2,)
    assert _core_list("0,3") == (0, 3)
    assert _core_list("0-1,3") == (0, 1, 3)
    assert _core_list("") is None


def test_default_is_one_chip():
    assert torch.neuron.device_count() == ae._engine.ENGINE.spec.chip_cores == 4
    assert torch.accelerator.device_count() == 4


@pytest.mark.parametrize("setting,count", [({"visible_cores": (0, 1)}, 2),
                                           ({"visible_cores": (2,)}, 1),
                                           ({"visible_cores": (0, 3)}, 2),
                                           ({"num_cores": 3}, 3),
                                           ({"visible_cores": (1,), "num_cores": 3}, 1)])
def test_runtime_variables_restrict_the_count(setting, count):
    with ae.override(**setting):
        assert torch.neuron.device_count() == count


def test_cores_the_chip_lacks_are_refused():
    with ae.override(visible_cores=(4,)), pytest.raises(RuntimeError, match="NEURON_RT_VISIBLE"):
        torch.neuron.device_count()
    with ae.override(num_cores=9), pytest.raises(RuntimeError, match="NEURON_RT_NUM_CORES=9"):
        torch.neuron.device_count()


def test_env_is_read_at_start_up():
    code = "import torch, adaptive_eager; print(torch.neuron.device_count())"
    for env, want in (({"NEURON_RT_VISIBLE_CORES": "0-1"}, "2"),
                      ({"NEURON_RT_NUM_CORES": "1"}, "1")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**__import__("os").environ, **env}, timeout=120)
        assert out.stdout.strip() == want, out.stderr


def test_a_second_core_is_refused_with_the_reason():
    with pytest.raises(RuntimeError, match="one NeuronCore per process.*NEURON_RT_VISIBLE_CORES=1"):
        torch.zeros(2, device="neuron:1")
    with pytest.raises(RuntimeError, match="one NeuronCore per process"):
        torch.neuron.set_device(1)
    with ae.override(visible_cores=(1,)), pytest.raises(RuntimeError, match="neuron:1 does not"):
        torch.ones(2).to("neuron:1")
    assert torch.ones(2, device="neuron:0").device == torch.device("neuron:0")
