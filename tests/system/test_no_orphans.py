"""Nothing left running: a trainer killed with -9 (what the OOM killer sends) takes the processes it forked with
it, and a resume right after finds its folder free. Real processes, a real SIGKILL, through the CLI."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def children(pid: int) -> set[int]:
    """The live child processes of `pid`, from /proc."""
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            pass
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has ended; only its exit status is left for a reaper


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def newest_checkpoint(out: Path) -> int:
    return max((int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")), default=0)


def cli(out: Path, *args) -> list[str]:
    return [sys.executable, "-m", "grpo.train", "recipes/tiny.py", "--async_generation=true", f"--output_dir={out}",
            "--num_generations=2", "--save_steps=1", *args]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads child processes from /proc")
def test_a_trainer_killed_with_sigkill_leaves_no_sampler_and_a_free_folder(tmp_path):
    out = tmp_path / "run"
    trainer = subprocess.Popen(cli(out, "--max_steps=300"), cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: newest_checkpoint(out) >= 1 or trainer.poll() is not None, 240, "a first checkpoint")
        assert trainer.poll() is None, trainer.stderr.read()[-2000:]
        forked = children(trainer.pid)
        assert forked, "an async run has its sampler process"
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        trainer.stderr.close()
    t0 = time.monotonic()
    wait_for(lambda: not any(alive(pid) for pid in forked), 10, f"the sampler {forked} to end with its trainer")
    print(f"the sampler ended {time.monotonic() - t0:.2f} s after its trainer")
    steps = newest_checkpoint(out)
    resumed = subprocess.run(cli(out, f"--max_steps={steps + 1}", "--resume_from_checkpoint=latest"), cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (out / f"checkpoint-{steps + 1}").is_dir()


def test_a_forked_child_does_not_hold_the_run_lock(tmp_path):
    """The lock is the run's process's own: a process it forks (and keeps alive) lets go of its copy."""
    from grpo.run import lock

    class OneRank:
        is_main, world_size = True, 1

    started, ready = os.pipe()
    with lock.hold(tmp_path, OneRank()):
        pid = os.fork()
        if pid == 0:  # the child lives on, holding whatever it inherited
            os.write(ready, b"x")
            time.sleep(30)
            os._exit(0)
        os.read(started, 1)  # the child runs: os.fork has returned there
    try:
        lock.check_free(str(tmp_path), OneRank())  # ConfigError if the folder is still held
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
