"""Running tool calls where a timeout can stop them: each call in a process of its own, killed (SIGKILL) when its
`timeout_s` is up; the model reads TRL's error text, as for a call that raises. Where a call runs, and what comes
back of an environment's state: docs/tools.md, "Where calls run, and timeouts"."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass

from ...infra.children import die_with_parent


def error_text(message: str) -> str:
    """What the model reads for a failed call: TRL's tool content for an error, `str({"error": message})`."""
    return str({"error": message})


@dataclass(frozen=True)
class Outcome:
    """A call's result as the model reads it, whether the call failed, and why (for completions.jsonl)."""

    text: str
    failed: bool
    why: str | None = None


def _outcome(thunk) -> Outcome:
    """Run `thunk` (awaiting what it returns, for an async tool) and say how it went."""
    try:
        value = thunk()
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
    except Exception as e:  # the model reads the error, as TRL feeds it back
        return Outcome(error_text(str(e)), failed=True, why=f"raised {type(e).__name__}: {e}")
    return Outcome(str(value), failed=False)


async def _awaited(awaitable):
    return await awaitable


def _owner(thunk):
    """The object whose bound method `thunk` calls (an environment), or None (functions, classmethods, builtins)."""
    fn = getattr(thunk, "func", thunk)
    owner = getattr(fn, "__self__", None)
    return None if owner is None or inspect.ismodule(owner) or inspect.isclass(owner) else owner


def _fork(body) -> tuple[int, multiprocessing.connection.Connection]:
    """Fork a child that runs `body(conn)` and exits; (its pid, the parent's end of their pipe)."""
    parent_end, child_end = multiprocessing.Pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the trainer's code
        code = 0
        try:
            parent_end.close()
            die_with_parent(parent)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            body(child_end)
        except BaseException:  # noqa: BLE001 -- the parent sees the pipe close and says so
            code = 1
        finally:
            os._exit(code)
    child_end.close()
    return pid, parent_end


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def _answer(thunk, owner) -> tuple[Outcome, bytes | None]:
    """`thunk`'s outcome, and when it is a bound method (`owner`: its object) that object's state after it."""
    outcome = _outcome(thunk)
    if owner is None:
        return outcome, None
    try:
        return outcome, pickle.dumps(vars(owner))
    except Exception as e:  # noqa: BLE001 -- the call made its object's state unpicklable
        return Outcome(error_text(f"state not kept: {e}"), failed=True,
                       why=f"left {type(owner).__name__}'s state unpicklable ({e})"), None


def _serve(conn) -> None:
    """A worker's loop: run each pickled call it is sent, answer as `_answer` does."""
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            return
        try:
            thunk = pickle.loads(message)
        except Exception as e:  # noqa: BLE001 -- e.g. a module this worker cannot import
            conn.send((Outcome(error_text(str(e)), failed=True, why=f"could not be sent to its process ({e})"),
                       None))
            continue
        conn.send(_answer(thunk, _owner(thunk)))


class _Job:
    """One call running: where its answer comes (`conn`), until when, and how to stop it."""

    def __init__(self, conn, deadline: float, pid: int | None = None, owner=None, worker=None):
        self.conn, self.deadline, self.pid, self.owner, self.worker = conn, deadline, pid, owner, worker
        self.ended = False  # its process ended without answering

    def answer(self) -> Outcome:
        """The call's outcome; an object's state it sends back is copied into the trainer's object."""
        try:
            outcome, state = self.conn.recv()
        except (EOFError, OSError):
            self.ended = True
            return Outcome(error_text("the tool's process ended without an answer"), failed=True,
                           why="ended its process without an answer")
        if self.worker is None:
            self.conn.close()
            if self.pid is not None:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.pid, 0)
        if state is not None:
            vars(self.owner).clear()
            vars(self.owner).update(pickle.loads(state))
        return outcome

    def stop(self) -> None:
        """Kill the call's process (a thread is left to end on its own; its answer is never read)."""
        self.conn.close()
        if self.pid is not None:
            _kill(self.pid)


class ToolRunner:
    """Runs a decode step's tool calls, each under `timeout_s`, at most `max_workers` at once. Made once per run;
    its worker processes are forked as first needed and killed when it is garbage-collected or the process exits."""

    def __init__(self, timeout_s: float, max_workers: int | None = None):
        self.timeout_s = timeout_s
        self.max_workers = max_workers or max(8, os.cpu_count() or 1)
        self.pid = os.getpid()
        self.idle: list[tuple[int, multiprocessing.connection.Connection]] = []  # workers: (pid, conn)
        self.workers: list[int] = []  # every live worker's pid, for the finalizer
        self._warned: set[type] = set()
        weakref.finalize(self, _kill_all, self.workers, self.pid)

    def run(self, groups: list[list]) -> list[list[Outcome]]:
        """Run the calls and return their outcomes, group by group. `groups`: one list per row of argument-less
        callables; the groups run at once, a group's calls one after another in order. A raised exception, a
        timeout or a process that dies becomes `error_text` and a failure."""
        self._adopt()
        outcomes = [[None] * len(g) for g in groups]
        waiting = deque((g, 0) for g in range(len(groups)) if groups[g])
        running: dict = {}  # conn -> (job, group, index)

        def finish(conn, timed_out: bool) -> None:
            job, g, i = running.pop(conn)
            outcomes[g][i] = Outcome(error_text(f"timed out after {self.timeout_s:g} s"), failed=True,
                                     why=f"timed out after {self.timeout_s:g} s") if timed_out else job.answer()
            self._done(job, timed_out)
            if i + 1 < len(groups[g]):
                waiting.append((g, i + 1))
        try:
            while waiting or running:
                while waiting and len(running) < self.max_workers:
                    g, i = waiting.popleft()
                    job = self._start(groups[g][i])
                    running[job.conn] = (job, g, i)
                soonest = min(job.deadline for job, _, _ in running.values())
                for conn in multiprocessing.connection.wait(list(running), max(0.0, soonest - time.monotonic())):
                    finish(conn, timed_out=False)
                now = time.monotonic()
                for conn in [conn for conn, (job, _, _) in running.items() if job.deadline <= now]:
                    finish(conn, timed_out=True)
        finally:  # an interrupt or an error here: nothing it started goes on
            for job, _, _ in running.values():
                self._done(job, timed_out=True)
        return outcomes

    def _start(self, thunk) -> _Job:
        """Start `thunk` where it can run: a worker when it pickles (a bound method's object with it), else a process
        forked for it (a bound method's object's state coming back), else a thread (that state does not pickle)."""
        deadline = time.monotonic() + self.timeout_s
        owner = _owner(thunk)
        try:
            payload = pickle.dumps(thunk)
        except Exception:  # noqa: BLE001 -- a closure, a lambda, a class defined in a function
            payload = None
        if payload is not None:
            if not self.idle:
                self.idle.append(_fork(_serve))
                self.workers.append(self.idle[-1][0])
            pid, conn = self.idle.pop()
            conn.send_bytes(payload)
            return _Job(conn, deadline, pid=pid, owner=owner, worker=(pid, conn))
        try:
            pickle.dumps(None if owner is None else vars(owner))
        except Exception as e:  # noqa: BLE001 -- TypeError, PicklingError, AttributeError (no __dict__), ...
            if type(owner) not in self._warned:
                self._warned.add(type(owner))
                print(f"warning: the state of {type(owner).__name__} cannot be pickled ({type(e).__name__}: {e}), "
                      f"so its tools run in the trainer's process, where a timeout answers the model but cannot stop "
                      f"the call", file=sys.stderr)
            return self._in_thread(thunk, deadline)
        pid, conn = _fork(lambda conn: conn.send(_answer(thunk, owner)))
        return _Job(conn, deadline, pid=pid, owner=owner)

    def _done(self, job: _Job, timed_out: bool) -> None:
        """After a call's answer or timeout: its process killed if it still runs, else its worker kept for the next."""
        if timed_out or job.ended:
            job.stop()
            if job.worker is not None:
                self.workers.remove(job.pid)
        elif job.worker is not None:
            self.idle.append(job.worker)

    def _in_thread(self, thunk, deadline: float) -> _Job:
        answer, send = multiprocessing.Pipe(duplex=False)

        def body():
            outcome = _outcome(thunk)
            with contextlib.suppress(OSError):  # timed out: nobody reads it
                send.send((outcome, None))
        threading.Thread(target=body, name="grpo-tool", daemon=True).start()
        return _Job(answer, deadline)

    def _adopt(self) -> None:
        """In a process forked from the one that made this runner (the sampler), let go of that one's workers."""
        if os.getpid() != self.pid:
            for _, conn in self.idle:
                conn.close()
            self.idle, self.pid = [], os.getpid()
            self.workers[:] = []


def _kill_all(pids: list[int], parent: int) -> None:
    if os.getpid() == parent:  # a forked copy of the runner has no workers of its own to kill
        for pid in list(pids):
            _kill(pid)
        pids.clear()
