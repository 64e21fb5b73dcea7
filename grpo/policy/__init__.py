"""The model being trained: loading it (LoRA, 4-bit), its named forwards (sampling, log-probs, reference
log-probs), data parallelism across ranks, and the optimizer."""


def uses_bf16(bf16: bool | None, device_type: str) -> bool:
    """Whether a run computes in bf16: `bf16` None means on CUDA only (CPU kernels are slower in bf16, and
    float32 keeps CPU runs exact); True asks for the CUDA plan on CPU too (a rehearsal), False never."""
    return device_type == "cuda" if bf16 is None else bf16
