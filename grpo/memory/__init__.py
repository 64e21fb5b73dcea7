"""Predicting a run's peak GPU memory from the model's config and the settings alone: `estimate` (the
arithmetic), `known_models` (architectures and the write-up's measurements), `fit` (what fits, and the one
list of memory-saving changes that both `python -m grpo.plan` and the out-of-memory report use)."""
