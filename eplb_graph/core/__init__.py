"""The tables every path shares: a placement checked and inverted (``placement``), kept across
restarts (``placement_file``), and the per-layer lookup the routing op reads (``layer_lookup``)."""
