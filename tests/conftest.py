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



def pytest_collection_modifyitems(items):
    """Tests on the emulated ``npu`` device run last: installing it renames PrivateUse1 and makes
    ``npu`` this process's accelerator for good, which no test before them should see."""
    items.sort(key=lambda item: "npu_emulation" in getattr(item, "fixturenames", ()))
