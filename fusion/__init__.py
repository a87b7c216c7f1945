"""Recorded ops -> dependency graph -> fusable groups -> cached executables.
Knows nothing of tensor subclasses; depends only on `device`."""
