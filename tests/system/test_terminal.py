"""What a person watching a run sees: the training half of each step has its own progress, the steps' bar shows
the step's peak memory and a rate without the evaluations' time; --log_completions shows chat turns as lines;
grpo.plot draws the training diagnostics. Written to a pipe, as here, each bar is plain lines."""
import json
import re
import time

import pytest
from datasets import Dataset
from tiny_setup import digit_prompts, digit_share, tiny_model, tiny_tokenizer

from grpo import Config, Trainer
from grpo.plot import panels, read_metrics
from grpo.run.trackers import print_completions

EVAL_PROMPTS = 3  # an evaluation scores this many completions at once; a training batch, 8
SLEEP_S = 6.0


def slow_to_evaluate(completions, **kwargs):
    if len(completions) == EVAL_PROMPTS:
        time.sleep(SLEEP_S)
    return digit_share(completions)


@pytest.mark.slow  # two evaluations that sleep
def test_the_terminal_shows_the_whole_step(tmp_path, capsys):
    tokenizer = tiny_tokenizer()
    config = Config(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                    gradient_accumulation_steps=2, num_generations=4, max_completion_length=6, optim="adamw",
                    eval_strategy="steps", eval_steps=1, report_to="none")
    eval_dataset = Dataset.from_list([{"prompt": f"Write {k} digits:"} for k in range(1, EVAL_PROMPTS + 1)])
    Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer, reward_funcs=[slow_to_evaluate],
            train_dataset=digit_prompts(), eval_dataset=eval_dataset).train()
    err = capsys.readouterr().err
    # the training half: its own line per step, counting micro-batches
    for step in (1, 2):
        assert re.search(rf"^training step {step}: (\d+)/\1 micro-batch", err, re.M), err
    final = [line for line in err.splitlines() if line.startswith("grpo: 2/2 step")][-1]
    assert re.search(r"peak_mem=\d+\.\d\dGB", final), final
    # two evaluations of SLEEP_S each ran inside the bar: counted, the rate would be below 2 / (2 * SLEEP_S)
    rate = float(re.search(r"([\d.]+) step/s", final).group(1))
    assert rate > 1.5 / SLEEP_S, final


def test_log_completions_shows_chat_turns_as_lines(capsys, monkeypatch):
    row = {"step": 1, "prompt": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "What is 17 times 23? Use the tool."}],
           "completion": [{"role": "assistant", "content": "", "tool_calls": [
               {"type": "function", "function": {"name": "multiply", "arguments": {"a": 17, "b": 23}}}]},
               {"role": "tool", "name": "multiply", "content": "391"},
               {"role": "assistant", "content": "17 times 23 is 391."}],
           "reward": 1.0, "advantage": 0.5, "reward/f": None}
    print_completions(1, [row])  # rich's table
    out = capsys.readouterr().out
    assert "{'role'" not in out and "multiply(" in out and "391." in out and "advantage 0.500" in out
    monkeypatch.setitem(__import__("sys").modules, "rich.console", None)  # as if rich were not installed
    print_completions(1, [row])
    out = capsys.readouterr().out
    assert ("    prompt:\n      system: Be brief.\n      user: What is 17 times 23? Use the tool.\n    completion:\n"
            '      assistant: multiply({"a": 17, "b": 23})\n      tool: 391\n      assistant: 17 times 23 is 391.\n'
            ) in out and "reward=1.000  advantage=0.500  reward/f=-" in out


def test_plot_draws_the_training_diagnostics(tmp_path):
    pytest.importorskip("matplotlib", reason="grpo.plot needs the plot extra (matplotlib)")
    from grpo.plot import plot

    lines = [{"step": s, "reward": 0.1 * s, "rewards/acc/mean": 0.1 * s, "rewards/acc/std": 0.2, "loss": 0.5 / s,
              "loss/policy": 0.4 / s, "grad_norm": 1.0 / s, "entropy": 2.0, "clip_ratio/region_mean": 0.01,
              "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.01, "frac_reward_zero_std": 0.5,
              "learning_rate": 1e-5, "kl": 0.0, "tools/call_frequency": 1.0, "tools/failure_frequency": 0.0,
              "completions/mean_length": 10.0} for s in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    found = {name: keys for name, _, _, keys, _ in panels(read_metrics(tmp_path / "metrics.jsonl"))}
    assert found["reward.png"] == ["reward", "rewards/acc/mean"] and "kl.png" not in found  # beta = 0: no KL
    assert found["loss.png"] == ["loss", "loss/policy"] and found["grad_norm.png"] == ["grad_norm"]
    assert {"entropy.png", "clip_ratio.png", "frac_reward_zero_std.png", "learning_rate.png", "tools.png"} <= set(found)
    assert len(plot(tmp_path)) == len(found) + 1  # and curves.png
