"""Graph capture and replay with EPLB's tables in place: CUDA graphs and NPU graphs (``graph_capture``),
and the Ascend NPU backend's lazy import (``npu_backend``)."""
