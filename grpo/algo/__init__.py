"""GRPO's math as pure tensor functions: group-normalized advantages, chunked per-token log-probs from
hidden states, the clipped policy loss with its KL penalty. Nothing here knows a model, a Config or a file.

The choice lists live here, free of torch, so that checking a Config (grpo/settings) stays fast."""

SCALES = ("group", "batch", "none")  # advantages.group_advantages(scale=...)
# TRL's multi_objective_aggregation: group_advantages of the weighted sum, or advantages.normalized_sum_advantages
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
# loss.policy_loss(loss_type=...): TRL 1.16's values
LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # loss.policy_loss(importance_sampling_level=...)
# sampling_correction.sampling_correction(mode=...): TRL's vllm_importance_sampling_mode values
SAMPLING_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
LOGPROB_CHUNK_SIZE = 512  # logprobs.token_logprobs(chunk_size=...)'s default, and Config.logprob_chunk_size's
# logprobs: rows of the [V, H] weight gradient made per matmul when the LM head is not float32 (bounds the
# low-precision temporary added into the float32 accumulator); the memory planner counts it
HEAD_GRAD_BLOCK = 16384
