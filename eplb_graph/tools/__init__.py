"""What a user runs: the ``eplb-graph`` command line (``cli``), ``doctor`` before serving, and ``inspect``
of what the compiler made of a model (with the small models it builds, ``inspect_models``)."""
