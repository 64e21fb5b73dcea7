"""Producing a generation batch: drawing prompts, sampling completions (our KV-cached decoder), scoring them
with reward functions, and the batches the loss consumes; greedy evaluation reuses the same pieces."""
