"""The reference EP runtime and its harness, beside the product: the reference MoE decoder and the tiny
Hugging Face models (``models``), the multi-rank runtime (``runtime``), elastic EP (``elastic``), the
benchmark harness (``bench``) and their commands (``cli``: ``eplb-graph run | serve | join | bench | demo``).

It imports the product (``eplb_graph``) through its public names only; the product never imports it.
"""
