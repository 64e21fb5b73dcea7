"""Predicting a run's peak GPU memory from the model's config and the settings alone: `parts` (the bytes of each
part a run holds), `estimate` (the moments that hold them, the peak, the prompts a decode takes), `known_models`
(architectures and the write-up's measurements), `fit` (what fits, and the one list of memory-saving changes that
both `python -m grpo.plan` and the out-of-memory report use)."""
