"""Processes a run forks (the sampler, tool calls) end when the process that forked them ends, however it
ends: `kill -9` (what the OOM killer sends) gives no one a chance to clean up, so the child watches for itself.
On Linux the kernel sends it SIGKILL when its parent dies (`PR_SET_PDEATHSIG`); everywhere a thread in the
child checks its parent's pid, which changes once the parent is gone."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
WATCH_S = 0.5  # how often the watchdog looks at the parent's pid


def _parent_death_signal() -> bool:
    """Ask the kernel for SIGKILL when the parent dies (Linux); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(WATCH_S)
    os._exit(1)


def die_with_parent(parent_pid: int) -> None:
    """In a forked child: end this process when `parent_pid` (the process that forked it) ends. Called first
    thing in the child; a parent already gone by then ends it at once."""
    _parent_death_signal()
    if os.getppid() != parent_pid:  # it died before the signal was asked for
        os._exit(1)
    threading.Thread(target=_watch, args=(parent_pid,), name="parent-watchdog", daemon=True).start()


def drop_inherited(fd: int) -> None:
    """In a forked child: let go of the open file behind descriptor `fd` (a lock, a pipe's other end), leaving
    `/dev/null` at that number, so a Python object that still names it never closes someone else's file."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)
