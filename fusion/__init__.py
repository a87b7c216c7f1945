"""Recorded ops -> dependency graph -> fusable groups -> cached executables.
Knows nothing of tensor subclasses; depends only on `device`."""
import torch  # noqa: F401  (first: torch's import loads the neuron backend, which imports
# this package's modules; one of them imported before torch met itself half made)
