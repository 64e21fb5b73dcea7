"""The generation engines: what turns a generation batch's prompts into completions (our decoder, a vLLM server,
TRL's rollout_func, a sampler passed in), and the choice between them, made before any model loads."""
