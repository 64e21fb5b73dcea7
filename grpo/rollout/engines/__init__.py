"""The generation engines behind one interface (engine.Engine): our decoder, a vLLM server, TRL's rollout_func, a
sampler passed in; the tool loop and chat template they share; the choice between them, made before loading."""
