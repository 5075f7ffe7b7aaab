"""The one binding to upstream vLLM's EPLB control plane (``binding.UpstreamBinding``), the narrow
capability adaptations it installs (``capability``), the worker's transfer planning in upstream's
place (``transfer_peers``) and the stall watchdog (``watchdog``). Upstream decides; this adapts."""
