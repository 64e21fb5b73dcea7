"""The offline arithmetic task and the supervised warm start (done once per run folder)."""
import inspect
import logging
from pathlib import Path

import torch
from tiny_setup import tiny_model, tiny_tokenizer

from grpo.tasks import arithmetic
from grpo.tasks.gsm8k import answer_accuracy_reward, xml_format_reward
from grpo.settings.recipe import load_recipe
from grpo.tasks.sft import collate, encode_examples, supervised_warm_start, warm_start_once
from grpo.tasks.tiny import model_for, tiny_gpt2


def test_worked_solution_by_hand():
    assert arithmetic.worked(964, 494) == ("<reasoning>4+4+0=08\n6+9+0=15\n9+4+1=14</reasoning>\n"
                                           "<answer>1458</answer>")
    assert arithmetic.direct(12, 34) == "<reasoning></reasoning>\n<answer>46</answer>"


def test_demonstrations_earn_full_rewards():
    pairs = arithmetic.problems(50, digits=3, seed=0)
    demos = arithmetic.demonstrations(pairs, worked_share=0.5, seed=0)
    completions = [c for _, c in demos]
    answers = [row["answer"] for row in arithmetic.rows(pairs)]
    assert answer_accuracy_reward(completions, answers) == [1.0] * 50
    assert xml_format_reward(completions) == [1.0] * 50
    worked = sum(c != arithmetic.direct(a, b) for (a, b), (_, c) in zip(pairs, demos))
    assert 15 <= worked <= 35, "about half of them show the working"


def test_train_and_held_out_problems_never_overlap():
    train, held_out = arithmetic.split(num_train=5000, num_eval=500, digits=2)
    assert len(set(train)) == 5000 and len(set(held_out)) == 500
    assert not set(train) & set(held_out)
    assert all(10 <= a <= 99 and 10 <= b <= 99 for a, b in train + held_out)


def test_collate_puts_loss_on_completion_and_eos_only():
    tokenizer = tiny_tokenizer()
    encoded = encode_examples(tokenizer, [("Write 2 digits:", " 01"), ("Write 1 digits:", " 0")])
    ids, mask, labels = collate(encoded, tokenizer.pad_token_id)
    for (p, c), row_ids, row_mask, row_labels in zip(encoded, ids, mask, labels):
        n = len(p) + len(c)
        assert c[-1] == tokenizer.eos_token_id
        assert row_ids[:n].tolist() == p + c and row_mask.sum() == n
        assert row_labels[:len(p)].eq(-100).all() and row_labels[n:].eq(-100).all()
        assert row_labels[len(p):n].tolist() == c


def test_warm_start_fits_the_demonstrations_deterministically():
    tokenizer = tiny_tokenizer()
    examples = [(f"Write {k} digits:", " " + "0123456789"[:k]) for k in range(1, 10)]
    runs = []
    for _ in range(2):
        model = tiny_model(tokenizer, seed=0)
        metrics = supervised_warm_start(model, tokenizer, examples, steps=60, lr=1e-2, batch_size=4, seed=0)
        runs.append((metrics, [p.detach().clone() for p in model.parameters()]))
    (metrics, params), (metrics2, params2) = runs
    assert metrics["warm_start/loss_last"] < 0.3 * metrics["warm_start/loss_first"]
    assert metrics["warm_start/loss_last"] == metrics2["warm_start/loss_last"]
    assert all(torch.equal(a, b) for a, b in zip(params, params2)), "the seed fixes the warm start"


def test_a_warm_start_of_the_recipes_gpt2_logs_nothing():
    # transformers picks a model's loss by its class name, and GPT-2's names none: without the loss named, the
    # first loss computed logs a line about it (once per process: another test's loss may have used it up).
    # transformers' loggers do not propagate to pytest's: a handler of its own hears them.
    heard, handler = [], logging.Handler()
    handler.emit = heard.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        tokenizer = tiny_tokenizer()
        model = model_for(tokenizer, build=tiny_gpt2, hidden_size=32, num_layers=1, num_heads=2)
        supervised_warm_start(model, tokenizer, [("Write 2 digits:", " 01")], steps=1, lr=1e-2, batch_size=1,
                              seed=0)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [record.getMessage() for record in heard], [record.getMessage() for record in heard]


def test_a_warm_start_is_done_once_per_folder_and_settings(tmp_path, capsys):
    calls = []

    def warm_start():
        calls.append(1)
        tokenizer = tiny_tokenizer()
        return tiny_model(tokenizer, seed=len(calls)), tokenizer

    made, _ = warm_start_once(tmp_path / "warm_start", {"steps": 5}, warm_start)
    loaded, tokenizer = warm_start_once(tmp_path / "warm_start", {"steps": 5}, warm_start)  # a resume
    assert len(calls) == 1 and "loaded from" in capsys.readouterr().out
    assert all(torch.equal(a, b) for a, b in zip(made.state_dict().values(), loaded.state_dict().values()))
    assert tokenizer.get_vocab() == tiny_tokenizer().get_vocab()
    warm_start_once(tmp_path / "warm_start", {"steps": 6}, warm_start)  # other settings: done again
    assert len(calls) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["warm_start"]


def test_the_arithmetic_recipes_warm_start_can_be_shortened(monkeypatch):
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "arithmetic_tiny.py"
    monkeypatch.setenv("ARITHMETIC_WARM_START_STEPS", "100")
    steps = inspect.signature(load_recipe(str(recipe)).build_model).parameters["warm_start_steps"].default
    assert steps == 100
