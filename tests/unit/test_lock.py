"""The output folder's lock (grpo/run/lock.py): held by one process at a time, said in one line to the other,
gone with a process that dies, and taken by rank 0 alone under torchrun."""
import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import fcntl
from pathlib import Path

import pytest

from grpo.errors import ConfigError
from grpo.infra.distributed import Distributed
from grpo.run import lock

ROOT = Path(__file__).resolve().parents[2]
# Another process: take the lock on the folder, say so, then wait to be killed (or report its refusal).
# Without torch (infra/distributed.py imports it): one process's Distributed is that of world size 1, rank 0.
HOLDER = """
import sys, time
from pathlib import Path
from types import SimpleNamespace
from grpo.run import lock
from grpo.errors import ConfigError
try:
    with lock.hold(Path(sys.argv[1]), SimpleNamespace(is_main=True, world_size=1)):
        print("holding", flush=True)
        time.sleep(600)
except ConfigError as e:
    print(f"refused: {e}", flush=True)
"""


def other_process(folder: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), str(folder)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_second_holder_is_refused_in_one_line_naming_the_first(tmp_path):
    with lock.hold(tmp_path, Distributed()):
        other = other_process(tmp_path)
        line = other.stdout.readline().strip()
        assert other.wait(timeout=60) == 0
        assert line.startswith(f"refused: {tmp_path} is in use by another run (pid {os.getpid()} on ")
        assert line.endswith("): wait for it to end, or pick another output_dir")
        with pytest.raises(ConfigError, match="is in use by another run"):
            lock.check_free(str(tmp_path), Distributed())
    lock.check_free(str(tmp_path), Distributed())  # released on leaving
    with lock.hold(tmp_path, Distributed()):
        pass


def test_the_lock_of_a_killed_process_is_not_in_the_way(tmp_path):
    other = other_process(tmp_path / "run")
    assert other.stdout.readline().strip() == "holding"
    with pytest.raises(ConfigError, match=rf"pid {other.pid} on "):
        lock.check_free(str(tmp_path / "run"), Distributed())
    other.send_signal(signal.SIGKILL)
    other.wait(timeout=60)
    assert (tmp_path / "run" / lock.LOCK).read_text().startswith(f"pid {other.pid} on "), "left behind"
    lock.check_free(str(tmp_path / "run"), Distributed())
    with lock.hold(tmp_path / "run", Distributed()):
        assert (tmp_path / "run" / lock.LOCK).read_text().startswith(f"pid {os.getpid()} on ")


class TwoRanks:
    """Distributed's API as rank `rank` of two sees it, rank 0's objects coming from `main_says`."""

    def __init__(self, rank: int, main_says):
        self.rank, self.world_size, self.main_says = rank, 2, main_says

    @property
    def is_main(self):
        return self.rank == 0

    def gather_objects(self, items):
        return [self.main_says, *items] if self.rank else [*items, None]


def test_under_torchrun_rank_0_holds_it_and_every_rank_refuses_with_its_line(tmp_path):
    with lock.hold(tmp_path / "run", TwoRanks(1, None)):
        assert not (tmp_path / "run").exists(), "rank 1 neither makes the folder nor locks it"
    with lock.hold(tmp_path / "run", TwoRanks(0, None)):
        with pytest.raises(ConfigError, match="is in use by another run"):  # a second job's rank 0
            with lock.hold(tmp_path / "run", TwoRanks(0, None)):
                pass
        with pytest.raises(ConfigError, match="^rank 0 says no$"):
            with lock.hold(tmp_path / "run", TwoRanks(1, "rank 0 says no")):
                pass


def test_rank_0_alone_checks_the_folder_early_and_every_rank_learns_its_answer(tmp_path):
    with lock.hold(tmp_path / "run", Distributed()):
        # rank 1 of a job whose rank 0 still holds the folder for the run that is ending: it does not look
        lock.check_free(str(tmp_path / "run"), TwoRanks(1, None))
        with pytest.raises(ConfigError, match="^rank 0 says no$"):
            lock.check_free(str(tmp_path / "run"), TwoRanks(1, "rank 0 says no"))
        with pytest.raises(ConfigError, match=rf"in use by another run \(pid {os.getpid()} on "):
            lock.check_free(str(tmp_path / "run"), TwoRanks(0, None))


def test_a_run_that_loses_the_race_by_a_moment_still_names_the_holder(tmp_path):
    """The holder writes who it is just after taking the lock; a run that looks in between waits for the line."""
    path = tmp_path / lock.LOCK
    with open(path, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # taken, nothing written yet

        def write_soon():
            time.sleep(0.2)
            held.write("pid 1 on elsewhere, since then")
            held.flush()

        writer = threading.Thread(target=write_soon)
        writer.start()
        with pytest.raises(ConfigError, match=r"in use by another run \(pid 1 on elsewhere, since then\)"):
            lock.check_free(str(tmp_path), Distributed())
        writer.join()


def test_a_filesystem_without_locks_warns_at_the_hold_and_does_not_fail_the_early_check(tmp_path, monkeypatch,
                                                                                          capsys):
    (tmp_path / lock.LOCK).write_text("pid 1 on a host that ended")

    def no_locks(f, how):
        raise OSError(errno.ENOLCK, "No locks available")  # as NFS without a lock daemon says

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock.check_free(str(tmp_path), Distributed())  # no refusal, no OSError
    with lock.hold(tmp_path, Distributed()):
        pass
    assert "cannot be locked (No locks available)" in capsys.readouterr().err
