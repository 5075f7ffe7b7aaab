"""FX passes that insert EPLB routing into traced MoE graphs, and their verifier."""
