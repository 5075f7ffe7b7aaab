"""Moving experts: the Gloo-staged communicator upstream's worker moves through (``mover``), the view
of the exact storage a kernel reads (``weight_views``), and the expert kernels over it (``expert_kernels``)."""
