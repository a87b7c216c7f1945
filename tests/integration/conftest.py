import pytest


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters reset before and after the test (its compiled frames and
    guards must not leak from one test into another). The compile tests use it for every
    test (`pytestmark = pytest.mark.usefixtures("fresh_dynamo")`)."""
    import torch._dynamo
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
