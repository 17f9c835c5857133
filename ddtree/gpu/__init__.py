"""GPU proofs of the DDTree engine (need an NVIDIA GPU and vLLM with the change set; see ddtree/README.md)."""
