"""Tasks, data and models for recipes, tests and benchmarks: GSM8K's prompt and rewards, the offline
arithmetic task and its supervised warm start, tiny offline tokenizers and models. The engine never imports
this package."""
