"""What a run writes and how it survives: atomic checkpoints and exact resume, metrics and completions logs,
stop signals."""
