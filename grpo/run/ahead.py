"""Sampling ahead (`async_generation`): the next generation batch is made by a forked copy of the trainer, its own
process and thread, while the current one trains, with weights at most `max_staleness` optimizer steps old
(`Ahead`). The copy runs the trainer's own `generate` (prompts, sampling with tools and environments, rewards,
advantages, the log-probs fixed for the batch), so a batch it makes is the one the trainer would have made with
those weights; the old log-probs are taken with the weights it sampled with, and the loss's ratio to them
corrects for the lag. `max_staleness=0` waits for every batch: the synchronous step, bit for bit."""
from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import signal
import time
import traceback
from dataclasses import dataclass

import torch

from ..errors import ConfigError, TrainingStopped, resume_hint
from ..infra.children import die_with_parent
from ..infra.interrupts import StepAbandoned
from ..rollout.batches import Generation


class SamplerDied(TrainingStopped):
    """The sampler process ended without answering."""


@dataclass
class Sampled:
    """A generation batch from the sampler: training on it starts at optimizer step `step`; it was sampled with
    the weights after `version` optimizer steps; `prompts_after` is the prompt stream's position after its draw
    and `rng_after` torch's RNG state after making it (a batch the trainer waited for continues from it)."""

    step: int
    version: int
    generation: Generation
    prompts_after: dict
    rng_after: torch.Tensor | None = None

    def state_dict(self) -> dict:
        return {"step": self.step, "version": self.version, "generation": self.generation.state_dict(),
                "prompts_after": self.prompts_after}

    @classmethod
    def from_state_dict(cls, saved: dict, device: torch.device) -> Sampled:
        return cls(saved["step"], saved["version"], Generation.from_state_dict(saved["generation"], device),
                   saved["prompts_after"])


class Worker:
    """The forked sampler: `produce(step)` (the trainer's generate at optimizer step `step`) run on request with
    the trainable `params` that the trainer publishes into shared memory before each request (LoRA: its
    adapters; full fine-tuning: every weight, one shared copy), on half the CPU threads; `prompts` is the
    trainer's PromptStream, whose copy in the worker draws from the position each request names."""

    def __init__(self, produce, params: list[torch.Tensor], prompts, device: torch.device, release=lambda: None):
        self.params, self.device = params, device
        # The CPU's threads split between trainer and sampler, which now run at once.
        threads = torch.get_num_threads()
        sampler_threads = max(1, threads // 2)
        torch.set_num_threads(max(1, threads - sampler_threads))
        self.shared = [p.detach().clone().share_memory_() for p in params]  # [*p.shape] each
        self.conn, child = multiprocessing.Pipe()
        # fork: the worker starts with the trainer's model, tools, rewards and environments, no pickling; the
        # frozen weights stay shared (copy-on-write, never written).
        self.process = multiprocessing.get_context("fork").Process(
            target=_serve, args=(child, self.conn, os.getpid(), produce, params, self.shared, prompts, sampler_threads,
                                 release), daemon=True)
        self.process.start()
        child.close()

    def request(self, step: int, prompts: dict) -> None:
        """Sample the batch of optimizer step `step` from prompt position `prompts` with the current weights."""
        with torch.no_grad():
            for p, s in zip(self.params, self.shared):
                s.copy_(p)
        self.conn.send({"step": step, "prompts": prompts, "rng": torch.get_rng_state()})

    def receive(self, step: int) -> tuple[Generation, dict, torch.Tensor]:
        """The requested batch (for optimizer step `step`), its prompt position after and its RNG state after,
        waited for; the worker's error raised here; SamplerDied when it ended without answering."""
        while not self.conn.poll(0.5):
            if not self.process.is_alive():
                raise self.died(step)
        try:
            kind, payload = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise self.died(step) from None
        if kind == "error":
            raise payload
        made = torch.load(io.BytesIO(payload), weights_only=False)
        return Generation.from_state_dict(made["generation"], self.device), made["prompts"], made["rng"]

    def died(self, step: int) -> SamplerDied:
        self.process.join(timeout=5)
        code = self.process.exitcode
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit code {code}")
        return SamplerDied(f"the sampler process (pid {self.process.pid}) ended ({how}) while sampling the "
                           f"generation batch of step {step + 1}; the steps done are saved: to resume, set "
                           f"{resume_hint()}")

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def close(self) -> None:
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join()


def _serve(conn, trainers_end, trainer_pid: int, produce, params, shared, prompts, threads: int, release) -> None:
    """The worker's loop: answer each request with the batch, or with the error that made it fail. It ends with
    the trainer, whatever ends that (infra/children), and holds neither the trainer's end of the pipe (so the
    trainer's end closing is an end of file here) nor the run's lock (run/lock drops it at the fork)."""
    die_with_parent(trainer_pid)
    trainers_end.close()
    # The trainer handles the signals (it saves, then stops the worker); a terminal's Ctrl-C reaches both.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    release()
    for p, s in zip(params, shared):
        p.data = s  # the weights the trainer publishes
    while True:
        try:
            asked = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            return
        try:
            torch.set_rng_state(asked["rng"])
            prompts.load_state_dict(asked["prompts"])
            generation = produce(asked["step"])
            buffer = io.BytesIO()
            torch.save({"generation": generation.state_dict(), "prompts": prompts.state_dict(),
                        "rng": torch.get_rng_state()}, buffer)
            answer = ("generation", buffer.getvalue())
        except Exception as error:  # noqa: BLE001 -- raised again in the trainer
            answer = ("error", error)
        try:
            message = pickle.dumps(answer)
        except Exception:  # noqa: BLE001 -- an error that cannot be pickled goes as its traceback
            message = pickle.dumps(("error", RuntimeError(f"in the sampler process:\n{traceback.format_exc()}")))
        try:
            conn.send_bytes(message)
        except (BrokenPipeError, OSError):
            return


class Ahead:
    """Which generation batch the sampler makes when: the one training starts on at optimizer step s is asked
    for at step s - max_staleness (not before the batch in training started: one is sampled at a time), with the
    weights after that step's update; `schedule` (settings/schedule.Schedule) says where batches start. `take`
    hands the trainer each batch, `ask_ahead` asks for the next one, `for_checkpoint` is what a checkpoint keeps
    so that a resumed run trains on what the uninterrupted one did. The worker is forked at the first request."""

    def __init__(self, start_worker, prompts, schedule, total_steps: int, max_staleness: int):
        self.start_worker, self.prompts, self.schedule = start_worker, prompts, schedule
        self.total_steps, self.max_staleness = total_steps, max_staleness
        self.worker: Worker | None = None
        self.requested: tuple[int, int] | None = None  # (step, version) of the batch being sampled
        self.ready: Sampled | None = None  # received (or restored), not yet taken
        self.taken: Sampled | None = None  # the batch in training

    def take(self, step: int) -> Generation:
        """The generation batch training starts on at optimizer step `step`: sampled ahead, or asked for now
        (with the current weights) and waited for; its metrics say how stale it is and how long the wait was."""
        t0 = time.perf_counter()
        if self.ready is None or self.ready.step != step:
            self.ready = None
            if self.requested is None or self.requested[0] != step:
                self._request(step, version=step)
            self._receive()
        sampled, self.ready = self.ready, None
        self.taken = sampled
        self.prompts.load_state_dict(sampled.prompts_after)
        if sampled.version == step and sampled.rng_after is not None:  # waited for: the synchronous generate's
            torch.set_rng_state(sampled.rng_after)
        sampled.generation.metrics.update({"async/staleness": step - sampled.version,
                                           "async/wait_s": time.perf_counter() - t0})
        return sampled.generation

    def ask_ahead(self, step: int) -> None:
        """At optimizer step `step` (its update not yet done: the weights are `step`'s), ask for the next batch
        if it starts within max_staleness steps and none is being sampled or waiting."""
        following = next((s for s in range(step + 1, self.total_steps) if self.schedule.starts_generation(s)), None)
        if following is not None and following - self.max_staleness <= step and self.requested is None \
                and self.ready is None:
            self._request(following, version=step)

    def for_checkpoint(self, step: int) -> Sampled | None:
        """The batch a checkpoint after `step` optimizer steps must keep: one sampled with older weights than
        those, which a resumed run could not sample again (waited for if still being sampled). None when there
        is none, or when the sampler died before answering (the resumed run samples it anew)."""
        if self.taken is not None and self.taken.step == step and self.taken.version < step:
            return self.taken  # the step that started on it failed: resuming starts on it again
        if self.requested is not None and self.requested[1] < step:
            try:
                self._receive()
            except SamplerDied:
                return None
        return self.ready if self.ready is not None and self.ready.version < step else None

    def __enter__(self) -> Ahead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def restore(self, sampled: Sampled | None) -> None:
        """A resumed run's batch sampled ahead (Session.resume)."""
        self.ready = sampled

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker, self.requested = None, None

    def _request(self, step: int, version: int) -> None:
        if self.worker is None:
            self.worker = self.start_worker()
        self.worker.request(step, self.prompts.state_dict())
        self.requested = (step, version)

    def _receive(self) -> None:
        step, version = self.requested
        try:
            generation, prompts_after, rng_after = self.worker.receive(step)
        except StepAbandoned:  # still being sampled: a checkpoint waits for it
            raise
        except Exception:  # the worker's error, or it died: nothing is being sampled any more
            self.requested = None
            raise
        self.requested = None
        self.ready = Sampled(step, version, generation, prompts_after, rng_after)


def check_async(device: torch.device, custom_sampler: bool) -> None:
    """ConfigError where async_generation cannot run: the sampler is a fork of this process, which CUDA does not
    survive, running our own decoder."""
    if device.type != "cpu":
        raise ConfigError(f"async_generation=True samples in a forked process, which runs on the CPU only; the "
                          f"model is on {device.type}: set async_generation=False")
    if custom_sampler:
        raise ConfigError("async_generation=True samples with our own decoder: it cannot run a rollout_func or a "
                          "sampler passed to the Trainer; set async_generation=False")
