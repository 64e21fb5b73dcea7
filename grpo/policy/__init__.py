"""The model being trained: loading it (LoRA, 4-bit), its named forwards (sampling, log-probs, reference
log-probs), data parallelism across ranks, and the optimizer."""
