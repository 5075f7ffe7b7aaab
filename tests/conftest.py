import pytest
import torch

import eplb_graph  # noqa: F401  (registers torch.ops.eplb_graph)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with empty Dynamo caches and counters, so recompile counts are its own."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()

