"""Sampling ahead's scheduling (run/ahead.Ahead) with a fake worker: which batch is asked for when, with which
weights (the version), what a checkpoint keeps; and the real worker's threads and error text, with a pipeline
that makes nothing, and a stop signal landing while a batch is read."""
import os
import signal
import threading
from types import SimpleNamespace

import pytest
import torch

from grpo.infra.interrupts import StepAbandoned, StopSignals
from grpo.rollout.batches import Cut, Generation, Rollout
from grpo.run.ahead import Ahead, Worker
from grpo.run.state import TrainerState
from grpo.settings import Config
from grpo.settings.schedule import Schedule


class Prompts:
    epoch_rows = 8  # a dataset's length

    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class FakeWorker:
    """Answers each request at once with a batch naming the step and the weights' version it was asked with."""

    def __init__(self, pipeline, params, prompts, device, release):
        self.asked, self.pending, self.closed = [], [], False

    def request(self, step, prompts, state):
        self.asked.append((step, state.global_step))
        self.pending.append((step, prompts))

    def wait(self, step):
        assert self.pending

    def receive(self, step):
        asked, prompts = self.pending.pop(0)
        assert asked == step
        return SimpleNamespace(metrics={}, batch=f"batch of {step}"), {"position": prompts["position"] + 1}, None

    def close(self):
        self.closed = True


def ahead(max_staleness: int, total_steps: int = 6, **batch) -> Ahead:
    schedule = Schedule.resolve(Config(per_device_train_batch_size=4, num_generations=2, **batch))
    policy = SimpleNamespace(device=torch.device("cpu"), model=torch.nn.Linear(2, 2))
    pipeline = SimpleNamespace(source=SimpleNamespace(prompts=Prompts()), check_head=lambda batch: None,
                               policy=policy)
    return Ahead(pipeline, TrainerState(), schedule, total_steps, max_staleness, make_worker=FakeWorker)


def test_max_staleness_0_asks_for_each_batch_at_its_own_step_and_waits():
    a = ahead(0)
    for step in range(3):
        generation = a.take(step)
        assert generation.metrics["async/staleness"] == 0
    assert a.worker.asked == [(0, 0), (1, 1), (2, 2)]
    assert a.requested is None and a.ready is None  # nothing sampled ahead


def test_max_staleness_1_asks_for_the_next_batch_while_this_one_trains():
    a = ahead(1)
    assert a.take(0).batch == "batch of 0"
    assert a.requested == (1, 0)  # step 1's batch, with the weights of step 0
    assert a.take(1).metrics["async/staleness"] == 1
    assert a.requested == (2, 1)
    assert a.prompts.position == 2  # the stream continues after the batch taken
    a.close()
    assert a.worker is None


def test_a_batch_of_two_steps_is_asked_for_max_staleness_steps_before_it_starts():
    a = ahead(1, steps_per_generation=2)
    first = a.take(0)
    assert a.requested is None  # step 2's batch is due at step 1
    assert a.take(1) is first and a.requested == (2, 1)
    assert a.take(2).metrics["async/staleness"] == 1


def test_a_checkpoint_keeps_the_batch_sampled_with_older_weights():
    a = ahead(1)
    a.take(0)
    kept = a.for_checkpoint(1)  # after step 0's update: step 1's batch was sampled with step 0's weights
    assert kept is not None and (kept.step, kept.version) == (1, 0)
    a.take(1)
    assert a.for_checkpoint(1) is a.taken  # step 1 failed: resuming starts on its batch again
    b = ahead(0)
    b.take(0)
    assert b.for_checkpoint(1) is None  # synchronous: a resumed run samples it again


def test_a_failed_step_leaves_the_batch_in_training_as_it_found_it():
    a = ahead(1)
    first = a.take(0)
    with pytest.raises(ValueError), a.undone_on_failure():
        a.take(1)
        raise ValueError("step 1 failed")
    assert a.current is first and a.for_checkpoint(1) is a.taken  # resuming starts on step 1's batch again


class Failing:
    """A pipeline whose batch fails in the sampler process."""

    def quiet(self):
        pass

    def make(self, step, state):
        raise ValueError(f"no batch at step {step}")


def test_the_worker_gives_the_trainer_its_threads_back_and_its_error_with_the_child_traceback():
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        worker = Worker(Failing(), [], Prompts(), torch.device("cpu"))
        assert torch.get_num_threads() == 2  # half for the sampler
        worker.request(3, {"position": 0}, TrainerState(global_step=3))
        with pytest.raises(ValueError, match="no batch at step 3") as error:
            worker.receive(3)
        notes = "\n".join(getattr(error.value, "__notes__", []))
        assert "in the sampler process" in notes and "in make" in notes and "ValueError" in notes
        worker.close()
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(threads)


class CtrlCWhenRead:
    """In a batch's metrics: decoding the batch in the trainer sends the trainer SIGINT, as a Ctrl-C landing after
    the answer has left the pipe and before it is recorded would."""

    def __init__(self):
        self.step = 1

    def __setstate__(self, state):
        self.__dict__.update(state)
        os.kill(os.getpid(), signal.SIGINT)


class Sampling:
    """The sampler process's pipeline: a batch of two rows per step, step 1's read with a Ctrl-C."""

    def __init__(self):
        self.source = SimpleNamespace(prompts=Prompts())
        self.policy = SimpleNamespace(device=torch.device("cpu"), model=torch.nn.Linear(2, 2))

    def quiet(self):
        pass

    def check_head(self, batch):
        pass

    def make(self, step, state):
        ids, mask = torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
        rollout = Rollout(ids, mask, ids, mask, ["a", "b"], torch.zeros(2, dtype=torch.bool))
        return Generation(rollout, Cut(2, False, False), {"ctrl_c": CtrlCWhenRead()} if step == 1 else {})


def test_a_ctrl_c_while_a_batch_is_read_leaves_it_to_the_checkpoint_instead_of_waiting_for_it_forever():
    schedule = Schedule.resolve(Config(per_device_train_batch_size=2, num_generations=2))
    a = Ahead(Sampling(), TrainerState(), schedule, total_steps=4, max_staleness=1)
    threads = torch.get_num_threads()
    try:
        a.take(0)  # step 1's batch is now sampled with step 0's weights
        with StopSignals() as signals, pytest.raises(StepAbandoned), signals.abandonable():
            a.take(1)
        assert signals.received == signal.SIGINT
        kept = []  # what the checkpoint after step 1 keeps; the old code waited here for a batch already read
        waiting = threading.Thread(target=lambda: kept.append(a.for_checkpoint(1)), daemon=True)
        waiting.start()
        waiting.join(timeout=10)
        assert kept, "the checkpoint still waits for the batch read when the Ctrl-C landed"
        assert (kept[0].step, kept[0].version) == (1, 0) and "ctrl_c" in kept[0].generation.metrics
    finally:
        a.close()
        torch.set_num_threads(threads)


def test_what_async_generation_cannot_run_is_refused_in_one_check_before_loading():
    from grpo.errors import ConfigError
    from grpo.rollout.engines.choice import check_async

    check_async(1, "cpu", own_decoder=True)
    with pytest.raises(ConfigError, match="under torchrun"):
        check_async(2, "cpu", own_decoder=True)
    with pytest.raises(ConfigError, match="CPU only; the model is on cuda"):
        check_async(1, "cuda", own_decoder=True)
    with pytest.raises(ConfigError, match="rollout_func"):
        check_async(1, "cpu", own_decoder=False)
