"""`grpo.load_model` and `grpo.load_tokenizer`, the public loaders docs/tools.md calls with a model's name, load a
model as the trainer does: a folder's weights, in float32 on a CPU."""
import torch
from tiny_setup import tiny_model, tiny_tokenizer

from grpo import load_model, load_tokenizer


def test_load_model_takes_a_models_name(tmp_path):
    tokenizer = tiny_tokenizer()
    saved = tiny_model(tokenizer, seed=3)
    saved.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model = load_model(str(tmp_path))
    assert model.dtype == torch.float32
    for (name, param), (_, expected) in zip(model.named_parameters(), saved.named_parameters(), strict=True):
        assert torch.equal(param, expected), name
    assert load_tokenizer(str(tmp_path)).get_vocab() == tokenizer.get_vocab()
