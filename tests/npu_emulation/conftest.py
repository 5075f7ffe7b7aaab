import pytest


@pytest.fixture
def npu_emulation():
    """The emulated ``npu`` device, installed in this process for the rest of the session
    (tests/conftest.py runs the tests that take it after all others)."""
    from tests.npu_emulation import install

    return install()
