"""Pinned host memory with neuron as the accelerator (pinning buys nothing on the simulator,
but everyday code that asks for it must work)."""
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import adaptive_eager as ae


def test_pin_memory_copies_and_reports_pinned():
    x = torch.randn(3, 4)
    p = x.pin_memory()
    assert p.is_pinned() and not x.is_pinned()
    assert p[1:].is_pinned()  # views of pinned memory are pinned
    assert torch.equal(p, x) and p.data_ptr() != x.data_ptr()  # a copy, as PyTorch's
    assert p.pin_memory() is not None and p.stride() == x.stride()


def test_pinned_tensor_to_neuron_non_blocking(mode):
    x = torch.randn(8, 8)
    y = x.pin_memory().to("neuron", non_blocking=True)
    torch.testing.assert_close((y * 2).cpu(), x * 2)
    assert ae.metrics().h2d_bytes == x.numel() * 4


def test_dataloader_pin_memory(mode):
    ds = TensorDataset(torch.arange(10.0), torch.arange(10))
    total = 0.0
    for a, b in DataLoader(ds, batch_size=4, pin_memory=True):
        assert a.is_pinned() and b.is_pinned()
        total += a.to("neuron", non_blocking=True).sum().item()
    assert total == 45.0


def test_pinned_for_another_device_goes_to_pytorch():
    """Pinning for a device that is not neuron reaches PyTorch's own kernel (and its error
    on a machine without that device)."""
    with pytest.raises(RuntimeError, match="Cannot initialize CUDA") as info:
        torch.randn(2).pin_memory("cuda")
    assert "neuron" not in str(info.value)  # PyTorch's error, not one of ours
