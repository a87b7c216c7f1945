"""The `torch.backends` entry point: `import torch` registers `neuron` (unless
TORCH_DEVICE_BACKEND_AUTOLOAD=0, which torch itself honours before calling us)."""


def register() -> None:
    import adaptive_eager
    adaptive_eager._load_when_whole()  # Note [Lazy package]: the API, which registers the
    # device (once a module of ours that imported torch half made is whole)
