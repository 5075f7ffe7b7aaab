"""``eplb_graph.enable()`` on a PyTorch or Hugging Face model: the handle (``enable``), where a model keeps
its MoE layers (the model adapters: ``adapters``, ``adapter_base``, ``hf_adapter``), the router probe that
proves the attribution, and a kept placement to start from (``enable_placement``)."""
