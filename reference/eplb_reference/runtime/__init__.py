"""The reference EP runtime: the reference MoE decoder over real EP rank processes with live EPLB
(``eplb-graph run``, ``demo``, the multi-rank tests). Not what a vLLM or PyTorch user imports:
the product is ``eplb_graph``."""
