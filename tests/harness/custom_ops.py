"""A user's custom op that writes an argument (`torch.library`, `mutates_args`), with a neuron
kernel: shared by the kernel tests and the compile tests (auto_functionalized in a graph)."""
import torch


@torch.library.custom_op("aetest::axpy_", mutates_args=("y",))
def axpy_(a: float, x: torch.Tensor, y: torch.Tensor) -> None:
    y.add_(x, alpha=a)


@axpy_.register_kernel("neuron")
def _(a, x, y):
    y.add_(x, alpha=a)
