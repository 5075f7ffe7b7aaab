"""The benchmark harness behind ``eplb-graph bench``: models stepped side by side in the same
processes, their statistics and tables."""
