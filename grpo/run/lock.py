"""The output folder a run writes: checked writable before anything loads (`check_output_dir`), and one run at a
time in it: the kernel's lock (`flock`, gone with its process) on `OUTPUT_DIR/.grpo.lock`, whose text only names
the holder (docs/checkpoints-and-failures.md)."""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from ..errors import ConfigError, setting
from ..infra.children import drop_inherited

LOCK = ".grpo.lock"
_held: set = set()  # the lock files this process holds open


def _drop_in_child() -> None:
    for f in _held:
        drop_inherited(f.fileno())


os.register_at_fork(after_in_child=_drop_in_child)


def _holder(f, wait_s: float = 1.0) -> str:
    """Who holds the lock on `f`, as its holder wrote it. The holder writes right after taking the lock, so a run
    that lost the race by a moment waits up to `wait_s` for the line rather than say nothing."""
    deadline = time.monotonic() + wait_s
    while True:
        f.seek(0)
        holder = f.read().strip()
        if holder or time.monotonic() > deadline:
            return holder
        time.sleep(0.02)


def _refusal(f, output_dir: Path) -> str | None:
    """Take the lock on the open lock file `f` (not waiting); the in-use message if another run holds it."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(f) or "its holder did not say who it is"
        return (f"{output_dir} is in use by another run ({holder}): wait for it to end, or pick another "
                f"{setting('output_dir')}")
    return None


def _raise_on_every_rank(problem: str | None, dist) -> None:
    """Rank 0's `problem` (None: none) as a ConfigError on every rank of `dist`."""
    if dist.world_size > 1:
        problem = dist.gather_objects([problem])[0]
    if problem is not None:
        raise ConfigError(problem)


def check_output_dir(output_dir: str, setting: str = "output_dir") -> None:
    """Fail before any loading if `output_dir` cannot be created or written: a folder is made and removed
    again in its nearest existing parent (permissions alone say nothing for root, or on /proc). `setting`: the
    option the message names (grpo.eval checks its --output's folder)."""
    path = Path(output_dir).absolute()
    parent = next(p for p in (path, *path.parents) if p.exists())
    if not parent.is_dir():
        raise ConfigError(f"{setting}={output_dir} cannot be created: {parent} is a file, not a folder; "
                          f"pick another --{setting}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".grpo-write-test-", dir=parent))
    except OSError as error:
        raise ConfigError(f"{setting}={output_dir} cannot be {'written' if parent == path else 'created'}: "
                          f"making a folder in {parent} fails ({error.strerror}); pick a writable --{setting}"
                          ) from None


def check_free(output_dir: str, dist) -> None:
    """ConfigError, on every rank, if a live run holds `output_dir` now (checked before a model is loaded). Only
    rank 0 looks: a rank 1 could find its own job's rank 0 still holding the folder for a run that is ending."""
    problem = None
    path = Path(output_dir) / LOCK
    if dist.is_main and path.is_file():
        with open(path) as f:
            with contextlib.suppress(OSError):  # a filesystem without locks: the hold says so when it starts
                problem = _refusal(f, Path(output_dir))
    _raise_on_every_rank(problem, dist)


@contextlib.contextmanager
def hold(output_dir: Path, dist):
    """Hold the lock on `output_dir` (made if missing) for the body; ConfigError, on every rank, when another
    run holds it. Only rank 0 (of `dist`, infra/distributed.py's) takes it; the others learn its outcome."""
    lock, problem = None, None
    if dist.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        lock = open(output_dir / LOCK, "a+")  # noqa: SIM115 -- held open for the whole run
        try:
            problem = _refusal(lock, output_dir)
        except OSError as error:  # a filesystem without locks (ENOLCK): run, but say what is not guarded
            print(f"warning: {output_dir} cannot be locked ({error.strerror}): nothing stops a second run "
                  f"from writing into it at the same time", file=sys.stderr)
        if problem is not None:
            lock.close()
            lock = None
    _raise_on_every_rank(problem, dist)
    try:
        if lock is not None:
            lock.seek(0)
            lock.truncate()
            since = time.strftime("%Y-%m-%d %H:%M:%S")
            lock.write(f"pid {os.getpid()} on {socket.gethostname()}, since {since}")
            lock.flush()
            _held.add(lock)
        yield
    finally:
        if lock is not None:
            _held.discard(lock)
            lock.close()  # closing the file releases the lock
