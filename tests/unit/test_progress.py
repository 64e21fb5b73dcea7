"""Progress during long steps: the decoding loop reports each step's new tokens; evaluation rows carry the
dataset's reference columns; written to a file, a bar is a plain line every few seconds."""
import re

import torch

from grpo import Config
from grpo.settings.components import EvalSettings
from grpo.rollout.engines.decoding import decode
from grpo.rollout.evaluate import evaluate
from grpo.infra.progress import LINE_EVERY_S, LineProgress, TokenProgress, progress_bar
from grpo.rollout.engines.sampling import left_pad
from tiny_setup import decode_settings, digit_prompts, tiny_model, tiny_tokenizer


def half(completions, **kwargs):
    return [0.5] * len(completions)


def test_on_token_counts_every_generated_token_until_eos():
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer).eval()
    ids, mask = left_pad([tokenizer("Write 3 digits:")["input_ids"], tokenizer("Write 7 digits: 01")["input_ids"]],
                         tokenizer.pad_token_id)
    with torch.no_grad():
        first = int(model(ids[:1], attention_mask=mask[:1]).logits[0, -1].argmax())
    counts = []
    settings = decode_settings(max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=1, eos_ids=[first],
                              pad_id=tokenizer.pad_token_id)
    out = decode(model, ids, mask, settings, on_token=counts.append).completion_ids
    assert counts[0] == 2 and counts == sorted(counts, reverse=True)
    # Tokens up to and including each row's EOS are counted; padding after it is not.
    is_eos = out == first
    length = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full((2,), out.shape[1]))
    assert sum(counts) == int(length.sum())


def test_eval_rows_carry_the_reference_columns():
    tokenizer = tiny_tokenizer()
    seen = []
    settings = EvalSettings.of(Config(eval_accuracy_func="half", max_prompt_length=16, max_completion_length=3))
    _, samples = evaluate(tiny_model(tokenizer), tokenizer, digit_prompts(4), [half], settings, batch_size=2,
                          progress=True,
                          unsharded=lambda fn: seen.append(1) or fn(tiny_model(tokenizer)))
    assert [s["num_digits"] for s in samples] == [1, 2, 3, 4] and len(seen) == 2
    assert {"prompt", "completion", "reward/half", "num_digits"} <= samples[0].keys()


def test_a_bar_written_to_a_file_is_a_plain_line_every_few_seconds(capsys):
    # pytest's captured stderr is no terminal, as a log file is not.
    bar = progress_bar("grpo", total=3, unit="step")
    assert isinstance(bar, LineProgress) and bar.every == LINE_EVERY_S
    bar.every = 0.0  # as if each update came seconds after the one before
    for reward in ("0.1", "0.2"):
        bar.set_postfix(reward=reward)
        bar.update(1)
    bar.every = 3600.0  # within seconds: no line until the end
    bar.update(1)
    bar.close()
    lines = capsys.readouterr().err.split("\n")
    assert "\r" not in "".join(lines) and lines[-1] == ""
    assert [re.sub(r", \d+s, [\d.e+-]+ step/s", "", line) for line in lines[:-1]] == [
        "grpo: 1/3 step, reward=0.1", "grpo: 2/3 step, reward=0.2", "grpo: 3/3 step, reward=0.2"]
    with TokenProgress("sampling step 1") as progress:  # the token counter too: one line at its end
        progress(5)
        progress.prompts_done(1, 2)
        progress(7)
    line = capsys.readouterr().err
    assert re.fullmatch(r"sampling step 1: 12 tok, \d+s, [\d.e+-]+ tok/s, prompts 1/2\n", line)


def test_evaluation_progress_counts_prompts_as_their_rows_finish(capsys):
    with TokenProgress("eval") as progress:
        progress.bar.every = 0.0  # a line at every update
        progress.batch(0, 3, 5)
        for active in (3, 3, 1):  # two of the first batch's 3 rows finish after the 2nd step
            progress(active)
        progress.batch(3, 2, 5)
        progress(2)
    lines = [re.sub(r", \d+s, [\d.e+-]+ tok/s", "", line) for line in capsys.readouterr().err.splitlines()]
    assert lines == ["eval: 3 tok, prompts 0/5", "eval: 6 tok, prompts 0/5", "eval: 7 tok, prompts 2/5",
                     "eval: 9 tok, prompts 3/5"]
