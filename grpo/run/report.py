"""What a run reports while `train()` runs: the step bar; every logged line written (run/logs.py), kept in
`trainer.state.log_history` and passed to the callbacks' `on_log` (an evaluation's also to `on_evaluate`); and
what `train()` returns, transformers' `TrainOutput`."""
from __future__ import annotations

import time
from pathlib import Path
from typing import NamedTuple

from ..infra.progress import exclude_time, progress_bar
from .callbacks import Callbacks
from .logs import log_completions, log_eval, log_metrics
from .state import TrainerState


class TrainOutput(NamedTuple):
    """transformers' TrainOutput (its fields; transformers.trainer_utils is not imported: it costs seconds)."""

    global_step: int
    training_loss: float
    metrics: dict[str, float]


class Report:
    """One Trainer's reporting. Under torchrun every rank calls it (logging gathers) and rank 0 writes; every
    rank keeps the log_history and calls its callbacks."""

    def __init__(self, output_dir: Path, dist, trackers, state: TrainerState, callbacks: Callbacks,
                 reward_names: list[str], completions_per_step: int):
        self.output_dir, self.dist, self.trackers, self.state = output_dir, dist, trackers, state
        self.callbacks, self.reward_names, self.completions_per_step = callbacks, reward_names, completions_per_step
        self.start, self.losses, self.bar, self.last_step = time.perf_counter(), [], None, {}

    def begin(self, config: dict) -> None:
        """A `train()` call starts: its clock and losses, the trackers (given `config`, the Config as a dict with
        the call's resume_from_checkpoint), then the callbacks' on_train_begin."""
        self.start, self.losses, self.last_step = time.perf_counter(), [], {}
        self.trackers.start(self.output_dir, config, self.state.global_step)
        self.callbacks.on_train_begin()

    def steps_bar(self):
        """The bar of the steps (to enter once the steps begin, after any evaluation at the start)."""
        self.bar = progress_bar("grpo", total=self.state.max_steps, initial=self.state.global_step, unit="step",
                                enabled=self.dist.is_main, smoothing=0)  # s/step: the steps' average
        return self.bar

    def step(self, metrics: dict) -> dict:
        """A step is done: its loss counted, the bar advanced with its reward, KL and peak memory."""
        self.losses.append(metrics["loss"])
        self.last_step = {k: float(v) for k, v in metrics.items()}
        reward = f"{metrics['reward']:.3f}" if "reward" in metrics else "none scored"
        self.bar.set_postfix(reward=reward, kl=f"{metrics['kl']:.4f}", peak_mem=f"{metrics['memory/peak_gb']:.2f}GB")
        self.bar.update(1)
        return metrics

    def log(self, metrics: dict, batch, with_completions: bool) -> dict:
        """The step's metrics.jsonl line; `with_completions`, its generation batch's completions too."""
        line = log_metrics(self.output_dir, self.state.global_step, metrics, self.dist, self.trackers)
        if with_completions:
            log_completions(self.output_dir, self.state.global_step, batch, self.reward_names, self.dist,
                            self.trackers)
        return self._logged(line)

    def evaluation(self, metrics: dict, key_prefix: str = "eval") -> dict:
        """An evaluation's metrics.jsonl line (printed too), then the callbacks' on_log and on_evaluate; its keys
        begin with `key_prefix` (rollout/evaluate)."""
        if self.state.global_step == 0:  # an evaluate() before train() opens the run's folder; later, a folder
            Path(self.output_dir).mkdir(parents=True, exist_ok=True)  # gone is the run's end (run/logs)
        line = self._logged(log_eval(self.output_dir, self.state.global_step, metrics, self.dist.is_main,
                                     self.trackers, key_prefix))
        if self.bar is not None:  # the bar's s/step is the steps' own
            exclude_time(self.bar, metrics.get(f"{key_prefix}/seconds", 0.0))
        self.callbacks.on_evaluate(metrics)
        return line

    def output(self) -> TrainOutput:
        """This `train()` call's TrainOutput, once its metrics are logged as transformers logs them (the last
        entry of log_history, and on_log; not metrics.jsonl) and the callbacks' on_train_end has run. That last
        entry also holds the call's last step's metrics, as TRL's does with its default logging_steps=10. Its speed
        metrics are rounded as transformers rounds them (docs/coming-from-trl.md)."""
        steps, seconds = len(self.losses), time.perf_counter() - self.start
        training_loss = sum(self.losses) / max(steps, 0.001)  # transformers' guard: 0.0 when no step ran
        out = TrainOutput(self.state.global_step, training_loss, {
            "train_runtime": round(seconds, 4),
            "train_samples_per_second": round(steps * self.completions_per_step / seconds, 3),
            "train_steps_per_second": round(steps / seconds, 3), "train_loss": training_loss,
            "epoch": self.state.epoch})
        self.state.log_history.append({**self.last_step, **out.metrics, "step": out.global_step})
        self.callbacks.on_log(dict(out.metrics))
        self.callbacks.on_train_end()
        return out

    def _logged(self, line: dict) -> dict:
        self.state.log_history.append(line)
        # transformers' on_log gets the logs without the step, which is state.global_step.
        self.callbacks.on_log({k: v for k, v in line.items() if k != "step"})
        return line
