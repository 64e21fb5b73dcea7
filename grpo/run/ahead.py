"""Sampling ahead (`async_generation`): a sampler process runs the generation pipeline (rollout/pipeline) for the
next generation batch while the current one trains, with weights at most `max_staleness` optimizer steps old
(`Ahead`, run/supply's other implementation; docs/recipes-and-settings.md, "Sampling ahead")."""
from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import signal
import time
import traceback
import dataclasses

import torch

from ..errors import TrainingStopped, resume_hint
from ..infra.children import die_with_parent
from ..infra.interrupts import StepAbandoned, atomic
from ..rollout.batches import Generation
from .synchronous import Synchronous


class SamplerDied(TrainingStopped):
    """The sampler process ended without answering."""


@dataclasses.dataclass
class Sampled:
    """A generation batch from the sampler, trained on from optimizer step `step`, sampled with the weights after
    `version` steps; the prompt stream's position and torch's RNG state after it (a waited-for batch's)."""

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
    """The forked sampler: `pipeline.make(step, state)` run on request with the trainable `params` that the
    trainer publishes into shared memory before each request, on half the CPU threads (the trainer's own restored
    on `close`); `prompts` is the pipeline's PromptStream, whose copy in the worker draws from the position each
    request names; `release` frees what the sampler does not need (the optimizer's state)."""

    def __init__(self, pipeline, params: list[torch.Tensor], prompts, device: torch.device, release=lambda: None):
        self.params, self.device = params, device
        # The CPU's threads split between trainer and sampler, which now run at once.
        self.threads = torch.get_num_threads()
        sampler_threads = max(1, self.threads // 2)
        torch.set_num_threads(max(1, self.threads - sampler_threads))
        self.shared = [p.detach().clone().share_memory_() for p in params]  # [*p.shape] each
        self.conn, child = multiprocessing.Pipe()
        # fork: the worker starts with the trainer's model, tools, rewards and environments, no pickling; the
        # frozen weights stay shared (copy-on-write, never written).
        self.process = multiprocessing.get_context("fork").Process(
            target=_serve, args=(child, self.conn, os.getpid(), pipeline, params, self.shared, prompts,
                                 sampler_threads, release), daemon=True)
        self.process.start()
        child.close()

    def request(self, step: int, prompts: dict, state) -> None:
        """Sample the batch of optimizer step `step` from prompt position `prompts` with the current weights;
        `state`: the run's TrainerState as the reward functions see it at that step."""
        with torch.no_grad():
            for p, s in zip(self.params, self.shared):
                s.copy_(p)
        self.conn.send({"step": step, "prompts": prompts, "rng": torch.get_rng_state(), "state": state})

    def wait(self, step: int) -> None:
        """Until the answer for optimizer step `step` can be read; SamplerDied when the worker ended without one."""
        while not self.conn.poll(0.5):
            if not self.process.is_alive():
                raise self.died(step)

    def receive(self, step: int) -> tuple[Generation, dict, torch.Tensor]:
        """The requested batch (for optimizer step `step`), its prompt position after and its RNG state after,
        waited for (`wait`); the worker's error raised here; SamplerDied when it ended without answering."""
        self.wait(step)
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

    def close(self) -> None:
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        torch.set_num_threads(self.threads)


def _serve(conn, trainers_end, trainer_pid: int, pipeline, params, shared, prompts, threads: int, release) -> None:
    """The worker's loop: answer each request with the batch, or with the error that made it fail. It ends with
    the trainer, whatever ends that (infra/children), and holds neither the trainer's end of the pipe (so the
    trainer's end closing is an end of file here) nor the run's lock (run/lock drops it at the fork)."""
    die_with_parent(trainer_pid)
    trainers_end.close()
    # The trainer handles the signals (it saves, then stops the worker); a terminal's Ctrl-C reaches both.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    pipeline.quiet()  # the trainer's bar is shown
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
            generation = pipeline.make(asked["step"], asked["state"])
            buffer = io.BytesIO()
            torch.save({"generation": generation.state_dict(), "prompts": prompts.state_dict(),
                        "rng": torch.get_rng_state()}, buffer)
            answer = ("generation", buffer.getvalue())
        except Exception as error:  # noqa: BLE001 -- raised again in the trainer, with where it happened here
            where = f"in the sampler process:\n{traceback.format_exc().rstrip()}"
            error.add_note(where)
            answer = ("error", error)
        try:
            message = pickle.dumps(answer)
        except Exception:  # noqa: BLE001 -- an error that cannot be pickled goes as its traceback
            message = pickle.dumps(("error", RuntimeError(where)))
        try:
            conn.send_bytes(message)
        except (BrokenPipeError, OSError):
            return


class Ahead:
    """The batch of step s (run/supply's interface) made ahead: the one training starts on at optimizer step s is
    asked for at step s - max_staleness (one is sampled at a time), with the weights after that step's update.
    `pipeline` is what the sampler process runs, `state` the run's TrainerState, `release` what it frees on
    start. The batch in training is kept as run/synchronous keeps it; `for_checkpoint` is what a checkpoint keeps
    besides. The worker (`make_worker`, a Worker's signature) is started at the first request."""

    def __init__(self, pipeline, state, schedule, total_steps: int, max_staleness: int, release=lambda: None,
                 make_worker=None):
        self.pipeline, self.state, self.release = pipeline, state, release
        # What the sampler process samples with: the trainable weights (LoRA: its adapters).
        self.params = [p for p in pipeline.policy.model.parameters() if p.requires_grad]
        self.prompts = pipeline.source.prompts
        self.schedule, self.total_steps, self.max_staleness = schedule, total_steps, max_staleness
        self.make_worker = make_worker or Worker
        self.worker: Worker | None = None
        self.requested: tuple[int, int] | None = None  # (step, version) of the batch being sampled
        self.ready: Sampled | None = None  # received (or restored), not yet taken
        self.taken: Sampled | None = None  # the batch in training, as sampled
        self.in_training = Synchronous(self._next, schedule, pipeline.policy.device)  # made by _next

    def take(self, step: int) -> Generation:
        """The batch of optimizer step `step`: where a generation batch starts, the one sampled ahead, or asked for
        now and waited for (its metrics say how stale it is and how long the wait was); then the next one asked
        for if it is due."""
        generation = self.in_training.take(step)
        self.ask_ahead(step)  # sampled while this step trains
        return generation

    @property
    def current(self) -> Generation | None:  # the batch in training
        return self.in_training.current

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

    def state_dict(self, step: int) -> dict:
        """What a checkpoint after `step` optimizer steps keeps: the batch in training (run/synchronous) and the
        one `for_checkpoint` keeps."""
        ahead = self.for_checkpoint(step)
        return {**self.in_training.state_dict(step), "ahead": ahead.state_dict() if ahead is not None else None}

    def load_state_dict(self, saved: dict) -> None:
        """The inverse of `state_dict`: the batch sampled ahead is the next one taken."""
        self.in_training.load_state_dict(saved)
        ahead = saved.get("ahead")  # None in a checkpoint of a run that did not sample ahead
        self.ready = Sampled.from_state_dict(ahead, self.in_training.device) if ahead is not None else None

    def undone_on_failure(self):
        """A step that fails or is stopped inside leaves the batch in training as it found it; the batch it
        took stays `taken`, which a checkpoint keeps (`for_checkpoint`)."""
        return self.in_training.undone_on_failure()

    def __enter__(self) -> Ahead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker, self.requested = None, None

    def _next(self, step: int) -> Generation:
        t0 = time.perf_counter()
        if self.ready is None or self.ready.step != step:
            self.ready = None
            if self.requested is None or self.requested[0] != step:
                self._request(step, version=step)
            self._receive()
        sampled = self.taken = self.ready  # held by one of the two at every instant (for_checkpoint)
        self.ready = None
        self.prompts.load_state_dict(sampled.prompts_after)
        if sampled.version == step and sampled.rng_after is not None:  # waited for: the synchronous batch's
            torch.set_rng_state(sampled.rng_after)
        sampled.generation.metrics.update({"async/staleness": step - sampled.version,
                                           "async/wait_s": time.perf_counter() - t0})
        self.pipeline.check_head(sampled.generation.batch)  # the trainer's own policy, before it trains
        return sampled.generation

    def _request(self, step: int, version: int) -> None:
        if self.worker is None:
            self.worker = self.make_worker(self.pipeline, self.params, self.prompts, self.pipeline.policy.device,
                                           self.release)
        # The reward functions' trainer_state at that step, as the synchronous run's would be.
        state = dataclasses.replace(self.state, global_step=step,
                                    epoch=self.schedule.epoch(step, self.prompts.epoch_rows))
        with atomic():  # a stop signal cannot leave a request sent but not recorded, or half sent
            self.worker.request(step, self.prompts.state_dict(), state)
            self.requested = (step, version)

    def _receive(self) -> None:
        step, version = self.requested
        try:
            self.worker.wait(step)  # a stop signal here leaves it being sampled: a checkpoint waits for it
            # Nor read but not recorded (a checkpoint would wait for it forever), nor read in part.
            with atomic():
                generation, prompts_after, rng_after = self.worker.receive(step)
                self.requested = None
                self.ready = Sampled(step, version, generation, prompts_after, rng_after)
        except StepAbandoned:
            raise
        except Exception:  # the worker's error, or it died: nothing is being sampled any more
            self.requested = None
            raise
