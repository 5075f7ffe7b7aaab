"""Importing this module installs the emulated ``npu`` device (``EPLB_GRAPH_NPU_MODULE`` names it
for rank processes; see ``tests/npu_emulation/__init__.py``)."""

from tests.npu_emulation import install

EMULATION = install()
