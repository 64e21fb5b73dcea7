"""The tiny model a vLLM server serves for the server tests (.ci/run starts one on it, tests/system/
test_vllm_server.py trains against it): `python tests/server_setup.py FOLDER` writes it. Sizes vLLM's CPU
kernels take (head_dim 64) and its LoRA layers (all linear layers), the tests' tokenizer."""
import sys

from tiny_setup import tiny_tokenizer

from grpo.tasks.tiny import model_for


def server_model(folder: str, seed: int = 0, initializer_range: float = 0.02, tokenizer=None) -> None:
    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer()
    model = model_for(tokenizer, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1,
                      seed=seed, initializer_range=initializer_range)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


if __name__ == "__main__":
    server_model(sys.argv[1])
