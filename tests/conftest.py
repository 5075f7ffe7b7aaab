import pytest
import torch

import eplb_graph  # noqa: F401  (registers torch.ops.eplb_graph)

# Files whose module fixtures start vLLM engines or servers, two processes at a time: one unit of
# work for one of make test's two workers, handed out first, while the other runs everything else
# (two of them at once would only share the same two cores).
VLLM_ENGINE_FILES = ("tests/eplb_graph/vllm_plugin/test_engine_quantized.py", "tests/eplb_graph/vllm_plugin/test_server.py",
                     "tests/eplb_graph/vllm_plugin/test_engine.py")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with empty Dynamo caches and counters, so recompile counts are its own."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def order(item: pytest.Item) -> tuple[bool, int]:
    """The vLLM engine files first (the longest unit of work, handed out first); tests on the
    emulated ``npu`` device last: installing it renames PrivateUse1 and makes ``npu`` this
    process's accelerator for good, which no test before them should see."""
    path = file_of(item)
    first = VLLM_ENGINE_FILES.index(path) if path in VLLM_ENGINE_FILES else len(VLLM_ENGINE_FILES)
    return "npu_emulation" in getattr(item, "fixturenames", ()), first


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=order)
    for item in items:  # with -n (make test): a file is one unit of work, its module fixtures built once
        path = file_of(item)
        item.add_marker(pytest.mark.xdist_group("vllm engines" if path in VLLM_ENGINE_FILES else
                                                path.removeprefix("tests/").removesuffix(".py")))
