"""The model being trained: loading it (LoRA, 4-bit), its named forwards (sampling, log-probs, reference
log-probs), data parallelism across ranks, and the optimizer."""

def prompt_once(shared_prompt_forward: bool | None, gradient_checkpointing: bool) -> bool:
    """Whether the training forwards run each distinct prompt once (policy/prefix.py): as asked, and when not
    asked (None) only without gradient checkpointing. Exact under checkpointing too, but there its measured
    peaks were higher than whole rows' on some shapes (docs/benchmarks.md, "Each prompt once in the training
    forwards"), for a reason not found and which the memory plan does not predict; and a run that checkpoints
    is short of memory."""
    return not gradient_checkpointing if shared_prompt_forward is None else shared_prompt_forward


def uses_bf16(bf16: bool | None, device_type: str) -> bool:
    """Whether a run computes in bf16: `bf16` None means on CUDA only (CPU kernels are slower in bf16, and
    float32 keeps CPU runs exact); True asks for the CUDA plan on CPU too (a rehearsal), False never."""
    return device_type == "cuda" if bf16 is None else bf16
