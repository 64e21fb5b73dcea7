"""Predicting a run's peak GPU memory from the model's config and the settings alone (its modules:
docs/architecture.md; what it counts: docs/memory-planner.md)."""
