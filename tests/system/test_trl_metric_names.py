"""A training step logs under TRL 1.16's metric names wherever TRL logs the same quantity, in metrics.jsonl,
`state.log_history` and the callbacks' on_log alike (the trackers get metrics.jsonl's lines:
test_trackers.py); every key TRL's GRPOTrainer logs is either logged or listed here with why not; an old run's
metrics.jsonl reads under today's names."""
import inspect
import json
import re
import statistics

import pytest
from tiny_setup import digit_prompts, digit_share, text_length, tiny_model, tiny_tokenizer

from grpo import Config, Trainer
from grpo.run.metric_names import trl_names

# TRL 1.16 GRPOTrainer._metrics keys this trainer does not log, and why.
NOT_LOGGED = {
    "num_tokens": "the running count of tokens seen is not kept",
    "clip_ratio/low_min": "the per-sequence clip shares' min and max are not computed",
    "clip_ratio/high_max": "the per-sequence clip shares' min and max are not computed",
    "aux_loss": "no router auxiliary loss (MoE)",
}
# Keys TRL logs only with vLLM (issue 55's) or only for some settings (policy_loss and entropy_coef: with
# entropy_coef, test_trl_everyday.py): checked where those run.
ONLY_WITH = ("sampling/", "tools/", "cispo_clip_ratio", "vespo/", "policy_loss", "entropy_coef")


class Seen:
    """A transformers-style callback that keeps what on_log got."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tokenizer, seen = tiny_tokenizer(), Seen()
    out = tmp_path_factory.mktemp("names") / "run"
    config = Config(output_dir=str(out), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                    max_prompt_length=16, max_completion_length=6, beta=0.04, learning_rate=1e-2, optim="adamw",
                    seed=0)
    trainer = Trainer(config, model=tiny_model(tokenizer), tokenizer=tokenizer,
                      reward_funcs=[digit_share, text_length], train_dataset=digit_prompts(), callbacks=[seen])
    trainer.train()
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return trainer, seen, lines, out


def test_a_step_logs_trls_names_everywhere(run):
    trainer, seen, lines, out = run
    trl = {"reward", "reward_std", "rewards/digit_share/mean", "rewards/digit_share/std", "rewards/text_length/mean",
           "rewards/text_length/std", "learning_rate", "grad_norm", "loss", "kl", "entropy", "epoch", "step_time",
           "frac_reward_zero_std", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
           "completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
           "completions/mean_terminated_length", "completions/min_terminated_length",
           "completions/max_terminated_length"}
    assert len(lines) == 2
    for line, history, logged in zip(lines, trainer.state.log_history, seen.logs):
        assert trl <= line.keys(), trl - line.keys()
        assert not {"reward/mean", "reward/std", "lr", "perf/step_s"} & line.keys()
        assert not [k for k in line if k.startswith("reward/")]
        assert history == line and logged == {k: v for k, v in line.items() if k != "step"}
    assert [line["epoch"] for line in lines] == [trainer.schedule.epoch(s, 8) for s in (1, 2)]
    assert lines[0]["learning_rate"] == pytest.approx(1e-2)  # TRL's constant schedule, no warmup: the rate
    # TRL's reward_std: the sample std (Bessel's correction) of the step's rewards, as in completions.jsonl
    rows = [json.loads(r) for r in (out / "completions.jsonl").read_text().splitlines() if json.loads(r)["step"] == 1]
    assert lines[0]["reward_std"] == pytest.approx(statistics.stdev(r["reward"] for r in rows), rel=1e-5)
    assert lines[0]["rewards/text_length/std"] == pytest.approx(
        statistics.stdev(r["reward/text_length"] for r in rows), rel=1e-5)
    assert lines[0]["completions/min_terminated_length"] <= lines[0]["completions/max_terminated_length"] <= 6


def test_every_key_trls_grpo_trainer_logs_is_logged_or_said_why_not(run):
    trl_trainer = pytest.importorskip("trl.trainer.grpo_trainer", reason="trl (a test peer) is not installed")
    source = inspect.getsource(trl_trainer.GRPOTrainer)
    keys = set(re.findall(r'_metrics\[(?:mode|"train")\]\["([^"]+)"\]', source))
    keys |= {k.replace("{reward_func_name}", "digit_share") for k in
             re.findall(r'_metrics\[mode\]\[f"([^"]+)"\]', source)}
    assert {"reward", "reward_std", "rewards/digit_share/mean", "step_time", "clip_ratio/high_max"} <= keys, keys
    _, _, lines, _ = run
    missing = {k for k in keys - lines[0].keys() - NOT_LOGGED.keys() if not k.startswith(ONLY_WITH)}
    assert not missing, f"TRL logs {sorted(missing)}: log it under TRL's name, or say in NOT_LOGGED why not"
    assert not NOT_LOGGED.keys() & lines[0].keys(), "logged now: take it out of NOT_LOGGED"


def test_an_old_runs_lines_read_under_trls_names():
    old = {"step": 3, "reward/mean": 0.5, "reward/std": 0.1, "reward/acc": 0.4, "reward/acc_std": 0.2, "lr": 1e-5,
           "perf/step_s": 2.0, "kl": 0.01, "eval_rewards/acc/mean": 0.3}
    assert trl_names(old) == {"step": 3, "reward": 0.5, "reward_std": 0.1, "rewards/acc/mean": 0.4,
                              "rewards/acc/std": 0.2, "learning_rate": 1e-5, "step_time": 2.0, "kl": 0.01,
                              "eval_rewards/acc/mean": 0.3}
    new = {"step": 3, "reward": 0.5, "rewards/acc/mean": 0.4, "learning_rate": 1e-5}
    assert trl_names(new) == new
