"""Bounded-time, process-parallel reward execution: :class:`RewardExecutor`.

The executor scores a batch with a reward function in a pool of worker processes, with a wall-clock limit per sample,
so that no single completion (``\\boxed{9^{9^{9^{9}}}}``, a user reward that loops) can stall a run.

Contract:

- **Calls.** In the pool the reward is called on one sample at a time, ``reward([prompt], [completion], [answer])``,
  so a reward run in the pool must be element-wise (a sample's reward depends on that sample only), as every
  built-in reward is. In the main process (``workers=0``, or a reward that cannot run in a worker) it is called once
  on the whole batch, exactly as without an executor.
- **Time.** Each sample gets ``timeout_s`` seconds of wall-clock time, measured in the main process from the moment
  its worker is free to start it (loading the reward and its :meth:`warmup` in a new worker do not count). A sample
  over the limit scores ``timeout_value`` and is counted; its worker is killed (SIGKILL) and replaced, and the samples
  queued behind it move to the other workers. In the main process no limit can be enforced (a thread cannot be
  stopped): only the reward's own guards apply.
- **Errors.** A reward that raises on sample ``i`` (or a worker that dies while scoring it) stops the batch with a
  :class:`RewardError` that names the sample and carries the worker's traceback (``on_error="raise"``), or the sample
  scores ``error_value`` and is counted (``on_error="score"``). In the main process a batch call that raises is
  repeated sample by sample to find (and name, or score) the samples that raise. A worker's value that is not one
  number (a bare float for the batch, a string) stops the batch with a :class:`RewardError` that says what it was,
  whatever ``on_error`` says: it is a bug in the reward, not a sample it fails on.
- **Order and determinism.** Results come back in sample order and do not depend on the number of workers, the
  chunking or the timing; only *whether* a sample reaches the limit depends on timing, so the limit should be far
  above the time of a normal sample. The values are returned as the reward produced them; validate them with
  :func:`~rlexact.rewards.check_rewards`.
- **Which rewards run in the pool.** Those that pickle in the main process and unpickle in a fresh one: the built-in
  named rewards and classes or functions importable as ``"pkg.module:Name"``. A closure, lambda or locally defined
  class cannot be pickled: it runs in the main process, with a warning that says why. A reward that a worker fails to
  load (e.g. a function defined in a notebook's ``__main__``) falls back the same way.
- **Processes.** Workers are started with ``forkserver`` (``spawn`` where it does not exist), never by forking a
  process that may hold CUDA state or threads. The fork server preloads ``rlexact.rewards`` and the reward's module
  once, so replacing a killed worker costs a fork. Workers ignore SIGINT (the main process stops them) and, on Linux,
  die with their parent. :meth:`RewardExecutor.close` (or garbage collection, or interpreter exit) stops them.
- **Overlap.** :meth:`RewardExecutor.submit` returns a :class:`~concurrent.futures.Future` at once; the main thread can
  do other work (decode the next completions) while the workers score. Batches are scored in submission order.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

from lightning.pytorch.utilities import rank_zero_warn

from rlexact.rewards.base import RewardFn, check_batch_lengths, check_reward_signature, reward_name

__all__ = [
    "ON_ERROR",
    "RewardConfig",
    "RewardError",
    "RewardExecutor",
    "RewardResult",
    "close_shared_executors",
    "default_workers",
    "inside_reward_executor",
    "shared_executor",
]

OnError = Literal["raise", "score"]
ON_ERROR: tuple[str, ...] = ("raise", "score")

_VALUE_CHARS = 80  # a wrong return value is quoted up to this many characters
_EXAMPLE_CHARS = 2000  # a logged example keeps the prompt head and the completion tail up to this many characters
_POLL_S = 0.05  # the scheduler looks for newly submitted batches at least this often while workers are busy
_START_TIMEOUT_S = 300.0  # a worker that has not loaded the reward by then counts as unable to load it


def default_workers() -> int:
    """The CPUs this process may run on (its affinity mask) divided among the ranks of this node
    (``LOCAL_WORLD_SIZE``, 1 when unset), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS, Windows)
        cpus = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    return max(1, cpus // max(local, 1))


@dataclass(frozen=True)
class RewardConfig:
    """How rewards are executed (see :mod:`rlexact.rewards.executor`): worker processes, the per-sample time limit and
    what a timed-out or failing sample scores."""

    workers: int | None = None
    """Reward worker processes. None = the CPUs of this process divided among the ranks of the node; 0 = score in the
    main process (one call on the whole batch, no time limit)."""
    timeout_s: float | None = 10.0
    """Wall-clock limit per sample in seconds (None = no limit). A sample over it scores ``timeout_value``, its worker
    is replaced, and it is counted in ``reward/timeouts`` and ``reward/timeout_frac``."""
    timeout_value: float = 0.0
    """The reward of a sample that reached the time limit."""
    on_error: OnError = "raise"
    """``"raise"``: a reward that raises stops the step with an error naming the sample. ``"score"``: the sample
    scores ``error_value`` and is counted in ``reward/errors`` and ``reward/error_frac``."""
    error_value: float = 0.0
    """The reward of a sample whose reward raised, with ``on_error="score"``."""

    def __post_init__(self) -> None:
        w = self.workers
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise ValueError(f"reward.workers must be an int >= 0 (0 = in the main process) or None, got {w!r}")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or t == float("inf")):
            raise ValueError(f"reward.timeout_s must be a finite number of seconds > 0 or None, got {t!r}")
        for name in ("timeout_value", "error_value"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) == float("inf"):
                raise ValueError(f"reward.{name} must be a finite number, got {v!r}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"reward.on_error must be one of {list(ON_ERROR)}, got {self.on_error!r}")


class RewardError(RuntimeError):
    """A reward raised (or its worker died) on a sample; ``index`` is the sample, ``detail`` the worker traceback."""

    def __init__(self, message: str, index: int, detail: str = "") -> None:
        super().__init__(message + (f"\n{detail}" if detail else ""))
        self.index = index
        self.detail = detail


@dataclass
class RewardResult:
    """The rewards of one batch, in sample order, with what went wrong on the way.

    ``rewards`` are the reward's values as produced, not yet validated (pass them to
    :func:`~rlexact.rewards.check_rewards`): a list of floats from the pool, and in the main process whatever the reward
    returned for the batch (a list, a tensor, ...), untouched.
    """

    rewards: Any
    timeouts: list[int] = field(default_factory=list)
    """Indices of the samples that reached the time limit (ascending)."""
    errors: list[int] = field(default_factory=list)
    """Indices of the samples whose reward raised, with ``on_error="score"`` (ascending)."""
    timeout_example: str | None = None
    """The lowest-index timed-out sample as text (prompt head, completion tail), for logging."""
    error_example: str | None = None
    """The lowest-index failed sample as text, with the error."""

    def metrics(self) -> dict[str, float]:
        """``reward/timeouts``, ``reward/timeout_frac``, ``reward/errors``, ``reward/error_frac`` of this batch."""
        n = max(len(self.rewards), 1)
        return {
            "reward/timeouts": float(len(self.timeouts)),
            "reward/timeout_frac": len(self.timeouts) / n,
            "reward/errors": float(len(self.errors)),
            "reward/error_frac": len(self.errors) / n,
        }

    @classmethod
    def concat(cls, parts: Sequence[RewardResult]) -> RewardResult:
        """The results of consecutive batches as one (indices shifted; the first example of any part is kept)."""
        out = cls(rewards=[])
        for part in parts:
            offset = len(out.rewards)
            out.rewards.extend(part.rewards)
            out.timeouts.extend(i + offset for i in part.timeouts)
            out.errors.extend(i + offset for i in part.errors)
            out.timeout_example = out.timeout_example or part.timeout_example
            out.error_example = out.error_example or part.error_example
        return out


_SCOPE = threading.local()
_IN_WORKER = False


def inside_reward_executor() -> bool:
    """True in a reward worker process, and on a thread where an executor is running a reward in the main process.

    A reward that bounds its own time with an executor (:class:`~rlexact.rewards.MathReward`) checks this and scores
    directly instead of starting a nested pool."""
    return _IN_WORKER or getattr(_SCOPE, "depth", 0) > 0


class _InProcessScope:
    def __enter__(self) -> None:
        _SCOPE.depth = getattr(_SCOPE, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _SCOPE.depth -= 1


def _describe_sample(index: int, prompt: Any, completion: Any) -> str:
    """``sample <index>``, the head of its prompt and the tail of its completion (where the answer is), as text."""
    half = _EXAMPLE_CHARS // 2
    p, c = str(prompt), str(completion)
    p = p if len(p) <= half else p[:half] + "..."
    c = c if len(c) <= half else "..." + c[-half:]
    return f"sample {index}: prompt {p!r}, completion {c!r}"


def _bad_value_error(reward: Any, problem: str, index: int, prompt: Any, completion: Any) -> RewardError:
    """The error for a reward whose value for sample ``index`` is not one number (``problem``): it stops the batch
    whatever ``on_error`` says, which covers rewards that raise, not a reward that returns the wrong thing."""
    return RewardError(
        f"reward {reward_name(reward)} {problem} on {_describe_sample(index, prompt, completion)}. A reward returns "
        "a sequence of one number per sample, e.g. [1.0, 0.0]",
        index,
    )


class _BadValue(ValueError):
    """What a reward returned for one sample is not one number."""


def _single_value(out: Any) -> float:
    """The one value a reward returned for a one-sample batch, as a float (NaN/inf are left to check_rewards);
    :class:`_BadValue` says what else it returned."""
    values = out.tolist() if hasattr(out, "tolist") else out
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise _BadValue(f"returned {type(out).__name__} {_short(out)} for 1 sample, not a sequence")
    if len(values) != 1:
        raise _BadValue(f"returned {len(values)} values for 1 sample")
    v = values[0]
    if isinstance(v, (str, bytes)):
        raise _BadValue(f"returned the string {_short(v)}, not a number")
    try:
        return float(v.item() if hasattr(v, "item") else v)
    except (TypeError, ValueError) as e:
        raise _BadValue(f"returned {type(v).__name__} {_short(v)}, not a number") from e


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _VALUE_CHARS else text[:_VALUE_CHARS] + "..."


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (the fork server, which exits with the main process) dies."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the pipe to the main process closing still ends an idle worker
        return


def _worker_main(conn: Connection, payload: bytes) -> None:
    """A worker: load the reward, report ready, then score [(key, prompt, completion, answer)] chunks one sample at a
    time, answering ``("ok", key, value)`` or ``("err", key, error, traceback)`` per sample. ``None`` or EOF ends it."""
    global _IN_WORKER
    _IN_WORKER = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    try:
        reward = pickle.loads(payload)
        warmup = getattr(reward, "warmup", None)
        if callable(warmup):
            warmup()
    except BaseException as e:  # reported to the main process, which falls back to scoring there
        conn.send(("load_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    while True:
        try:
            chunk = conn.recv()
        except EOFError:
            return
        if chunk is None:
            return
        for key, prompt, completion, answer in chunk:
            try:
                out = reward([prompt], [completion], [answer])
            except BaseException as e:  # anything a reward raises is the sample's error, reported with its traceback
                conn.send(("err", key, f"{type(e).__name__}: {e}", traceback.format_exc()))
                continue
            try:
                conn.send(("ok", key, _single_value(out)))
            except _BadValue as e:
                conn.send(("bad", key, str(e)))


def _load_advice(reward: Any) -> str:
    """What to change so that worker processes load ``reward``: the main script's guard where there is a main script
    (a forkserver or spawn worker runs it first), an importable module for a reward defined in ``__main__``."""
    advice = []
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if script is not None:
        advice.append(
            f"Worker processes import the main script ({script}) before the reward, as Python's forkserver and spawn "
            'start methods do: its code outside `if __name__ == "__main__":` (a Trainer.fit call, say) runs again '
            "there and stops the worker. Put that code under the guard"
        )
    if "__main__" in (getattr(reward, "__module__", None), type(reward).__module__) or script is None:
        advice.append("Define the reward at module level in an importable module to run it in worker processes")
    return ". ".join(advice) + "."


class _Job:
    """One submitted batch and its progress."""

    def __init__(self, seq: int, prompts: list, completions: list, answers: list) -> None:
        self.seq = seq
        self.prompts, self.completions, self.answers = prompts, completions, answers
        self.n = len(prompts)
        self.values: list[Any] = [None] * self.n
        self.left = self.n
        self.timeouts: dict[int, str] = {}
        self.errors: dict[int, str] = {}
        self.done = False
        self.future: Future[RewardResult] = Future()

    def item(self, i: int) -> tuple[tuple[int, int], Any, Any, Any]:
        return (self.seq, i), self.prompts[i], self.completions[i], self.answers[i]

    def result(self) -> RewardResult:
        t, e = sorted(self.timeouts), sorted(self.errors)
        return RewardResult(
            rewards=self.values,
            timeouts=t,
            errors=e,
            timeout_example=self.timeouts[t[0]] if t else None,
            error_example=self.errors[e[0]] if e else None,
        )


class _Worker:
    def __init__(self, proc: Any, conn: Connection) -> None:
        self.proc, self.conn = proc, conn
        self.ready = False
        self.items: deque[tuple[_Job, int]] = deque()  # items[0] is being scored since `since`
        self.since = 0.0
        self.started = time.monotonic()


class _Pool:
    """The scheduler behind a :class:`RewardExecutor`: its own thread, the worker processes, the queue of samples.

    Holds no reference to the executor, so an executor that is no longer used is collected and its pool stopped."""

    def __init__(self, reward: Any, payload: bytes | None, config: RewardConfig, workers: int, start_method: str):
        self.reward, self.payload, self.cfg = reward, payload, config
        self.workers = workers
        self.ctx = mp.get_context(start_method)
        self.inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.closed = False
        self.jobs: list[_Job] = []
        self.todo: deque[tuple[_Job, int]] = deque()
        self.procs: list[_Worker] = []
        self.in_process = payload is None

    # ---------------------------------------------------------------- main-thread side

    def submit(self, job: _Job) -> None:
        with self.lock:
            if self.closed:
                raise RuntimeError("this RewardExecutor is closed")
            if self.thread is None:
                if self.ctx.get_start_method() == "forkserver":
                    module = getattr(self.reward, "__module__", None) or "__main__"
                    self.ctx.set_forkserver_preload(["__main__", "rlexact.rewards", module])
                self.thread = threading.Thread(target=self.loop, name="rlexact-reward-executor", daemon=True)
                self.thread.start()
            self.inbox.put(job)

    def stop(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            thread = self.thread
        if thread is not None:
            self.inbox.put(None)
            if thread is not threading.current_thread():
                thread.join()

    # ---------------------------------------------------------------- scheduler thread

    def loop(self) -> None:
        try:
            while self.take_new(block=not self.jobs):
                if self.in_process:
                    self.todo.clear()
                    for job in list(self.jobs):
                        self.run_in_process(job)
                    continue
                self.fill()
                self.dispatch()
                self.receive()
                self.enforce_deadlines()
        except BaseException as e:  # a scheduler bug must not leave callers waiting forever
            for job in list(self.jobs):
                self.fail(job, RuntimeError(f"the reward executor's scheduler failed: {type(e).__name__}: {e}"))
            raise
        finally:
            for w in list(self.procs):
                self.retire(w, kill=bool(w.items))
            for job in list(self.jobs):
                self.fail(job, RuntimeError("the RewardExecutor was closed before the batch was scored"))
            while True:
                try:
                    late = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if late is not None and late.future.set_running_or_notify_cancel():
                    late.future.set_exception(RuntimeError("the RewardExecutor was closed before the batch was scored"))

    def take_new(self, *, block: bool) -> bool:
        """Move submitted batches into the queue; False when the executor is stopping."""
        while True:
            try:
                job = self.inbox.get(block=block, timeout=None if block else 0)
            except queue.Empty:
                return True
            block = False
            if job is None:
                return False
            if not job.future.set_running_or_notify_cancel():
                continue
            self.jobs.append(job)
            self.todo.extend((job, i) for i in range(job.n))
            self.finish_if_done(job)

    def fill(self) -> None:
        while len(self.procs) < self.workers:
            parent, child = self.ctx.Pipe()
            proc = self.ctx.Process(
                target=_worker_main, args=(child, self.payload), name="rlexact-reward-worker", daemon=True
            )
            proc.start()
            child.close()
            self.procs.append(_Worker(proc, parent))

    def dispatch(self) -> None:
        size = max(1, min(16, len(self.todo) // (2 * self.workers)))
        for w in self.procs:
            if not self.todo:
                return
            if w.ready and not w.items:
                chunk = [self.todo.popleft() for _ in range(min(size, len(self.todo)))]
                w.items.extend(chunk)
                w.since = time.monotonic()
                try:
                    w.conn.send([job.item(i) for job, i in chunk])
                except (BrokenPipeError, ConnectionError, EOFError):
                    self.died(w)

    def receive(self) -> None:
        timeout = _POLL_S
        if self.cfg.timeout_s is not None:
            now = time.monotonic()
            for w in self.procs:
                if w.items:
                    timeout = min(timeout, max(w.since + self.cfg.timeout_s - now, 0.0))
        for conn in wait([w.conn for w in self.procs], timeout=timeout):
            w = next((w for w in self.procs if w.conn is conn), None)
            try:
                while w is not None and w in self.procs and w.conn.poll():
                    self.handle(w, w.conn.recv())
            except (EOFError, ConnectionError, OSError):
                self.died(w)

    def handle(self, w: _Worker, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            w.ready = True
            return
        if kind == "load_error":
            self.fall_back(f"a worker process could not load it ({msg[1]})")
            return
        job, i = w.items.popleft()
        w.since = time.monotonic()
        if (job.seq, i) != msg[1]:
            raise RuntimeError(f"worker answered for {msg[1]} while scoring {(job.seq, i)}")
        if kind == "ok":
            self.settle(job, i, msg[2])
        elif kind == "bad":
            self.fail(job, _bad_value_error(self.reward, msg[2], i, job.prompts[i], job.completions[i]))
        else:
            self.sample_failed(job, i, msg[2], msg[3])

    def enforce_deadlines(self) -> None:
        now = time.monotonic()
        if any(not w.ready and now - w.started > _START_TIMEOUT_S for w in self.procs):
            self.fall_back(f"a worker process did not load it within {_START_TIMEOUT_S:.0f} s")
            return
        if self.cfg.timeout_s is None:
            return
        for w in list(self.procs):
            if w.items and now - w.since >= self.cfg.timeout_s:
                job, i = w.items.popleft()
                self.retire(w, kill=True)
                if not job.done:
                    job.timeouts[i] = _describe_sample(i, job.prompts[i], job.completions[i])
                    self.settle(job, i, self.cfg.timeout_value)

    def died(self, w: _Worker) -> None:
        """A worker's pipe broke: it died while loading the reward, or while scoring ``w.items[0]``."""
        was_ready = w.ready
        item = w.items.popleft() if w.items else None
        self.retire(w, kill=True)
        if not was_ready:
            self.fall_back(f"a worker process exited with code {w.proc.exitcode} while loading it")
        elif item is not None:
            job, i = item
            self.sample_failed(job, i, f"the worker process died (exit code {w.proc.exitcode})", "")

    def retire(self, w: _Worker, *, kill: bool) -> None:
        """Stop a worker (SIGKILL if it may be busy); the samples queued behind its current one go back in front."""
        self.procs.remove(w)
        if kill:
            w.proc.kill()
        else:
            try:
                w.conn.send(None)
            except (BrokenPipeError, ConnectionError, OSError):
                w.proc.kill()
        w.proc.join(timeout=5.0)
        if w.proc.exitcode is None:
            w.proc.kill()
            w.proc.join()
        w.conn.close()
        self.todo.extendleft(item for item in reversed(w.items) if not item[0].done)
        w.items.clear()

    def settle(self, job: _Job, i: int, value: Any) -> None:
        if job.done:
            return
        job.values[i] = value
        job.left -= 1
        self.finish_if_done(job)

    def sample_failed(self, job: _Job, i: int, error: str, detail: str) -> None:
        if job.done:
            return
        text = f"{_describe_sample(i, job.prompts[i], job.completions[i])}: {error}"
        if self.cfg.on_error == "raise":
            msg = f"reward {reward_name(self.reward)} raised on {text}"
            self.fail(job, RewardError(msg, i, detail))
        else:
            job.errors[i] = text
            self.settle(job, i, self.cfg.error_value)

    def finish_if_done(self, job: _Job) -> None:
        if job.left == 0 and not job.done:
            job.done = True
            self.jobs.remove(job)
            job.future.set_result(job.result())

    def fail(self, job: _Job, error: BaseException) -> None:
        if job.done:
            return
        job.done = True
        self.jobs.remove(job)
        self.todo = deque(item for item in self.todo if item[0] is not job)
        job.future.set_exception(error)

    def fall_back(self, why: str) -> None:
        """Score in the main process from now on (the workers cannot load the reward)."""
        if self.in_process:
            return
        rank_zero_warn(
            f"reward {reward_name(self.reward)} runs in the main process, without a time limit: {why}. "
            f"{_load_advice(self.reward)}"
        )
        self.in_process = True
        for w in list(self.procs):
            self.retire(w, kill=True)
        self.todo.clear()

    def run_in_process(self, job: _Job) -> None:
        try:
            result = _score_in_process(self.reward, job.prompts, job.completions, job.answers, self.cfg)
        except Exception as e:  # the caller gets the reward's error (RewardError naming the sample)
            self.fail(job, e)
            return
        job.done = True
        self.jobs.remove(job)
        job.future.set_result(result)


def _score_in_process(
    reward: RewardFn, prompts: list, completions: list, answers: list, cfg: RewardConfig
) -> RewardResult:
    """One call of ``reward`` on the whole batch in this thread (no time limit). If it raises, the samples are scored
    one at a time to name the first one that raises (``on_error="raise"``) or score the failing ones ``error_value``."""
    with _InProcessScope():
        try:
            out = reward(prompts, completions, answers)
        except Exception as batch_error:
            failures: dict[int, str] = {}
            values: list[Any] = []
            for i, (p, c, a) in enumerate(zip(prompts, completions, answers)):
                try:
                    out_i = reward([p], [c], [a])
                except Exception as e:  # the sample's error: named or scored below
                    failures[i] = f"{_describe_sample(i, p, c)}: {type(e).__name__}: {e}"
                    values.append(cfg.error_value)
                    if cfg.on_error == "raise":
                        raise RewardError(f"reward {reward_name(reward)} raised on {failures[i]}", i) from e
                    continue
                try:
                    values.append(_single_value(out_i))
                except _BadValue as e:
                    raise _bad_value_error(reward, str(e), i, p, c) from None
            if not failures:
                raise RewardError(
                    f"reward {reward_name(reward)} raised on the batch of {len(prompts)} samples but on none of "
                    f"them alone: {type(batch_error).__name__}: {batch_error}",
                    -1,
                ) from batch_error
            first = min(failures)
            return RewardResult(rewards=values, errors=sorted(failures), error_example=failures[first])
    return RewardResult(rewards=out)


def _merged_config(config: RewardConfig | None, overrides: dict[str, Any]) -> RewardConfig:
    """``config`` (default :class:`RewardConfig`) with the fields in ``overrides`` replaced; unknown names raise."""
    base = asdict(config if config is not None else RewardConfig())
    unknown = sorted(set(overrides) - set(base))
    if unknown:
        raise TypeError(f"unknown RewardExecutor options {unknown}; RewardConfig fields: {sorted(base)}")
    return RewardConfig(**{**base, **overrides})


class RewardExecutor:
    """Score batches with ``reward`` in worker processes with a time limit per sample (see the module docstring).

    Args:
        reward: a reward function ``(prompts, completions, answers) -> list[float]``.
        config: a :class:`RewardConfig`; keyword arguments override its fields (``workers=4, timeout_s=5``).
        start_method: ``"forkserver"`` (default where available) or ``"spawn"``.

    Use :meth:`run` (blocking), :meth:`submit` (a future) or call it like a reward (the values only). Close it with
    :meth:`close` or a ``with`` block; an executor that is garbage collected is closed too.
    """

    def __init__(
        self,
        reward: RewardFn,
        config: RewardConfig | None = None,
        *,
        start_method: Literal["forkserver", "spawn"] | None = None,
        **overrides: Any,
    ) -> None:
        if not callable(reward):
            raise TypeError(f"reward must be callable, got {type(reward).__name__}")
        check_reward_signature(reward)
        self.config = _merged_config(config, overrides)
        if start_method is None:
            start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
        self.reward = reward
        self.workers = default_workers() if self.config.workers is None else self.config.workers
        payload = None
        if self.workers > 0:
            try:
                payload = pickle.dumps(reward)
            except Exception as e:  # any pickling failure means: run in process, and say why
                rank_zero_warn(
                    f"reward {reward_name(reward)} runs in the main process, without a time limit: it cannot be "
                    f"pickled for a worker process ({type(e).__name__}: {e}). Define it at module level in an "
                    "importable module (or pass 'pkg.module:Name') to run it in worker processes."
                )
        self._seq = itertools.count()
        self._pool = _Pool(reward, payload, self.config, self.workers, start_method)
        self._finalizer = weakref.finalize(self, self._pool.stop)

    @property
    def in_process(self) -> bool:
        """True when the reward is scored in the main process (``workers=0``, or it cannot run in a worker)."""
        return self._pool.in_process

    @property
    def closed(self) -> bool:
        return self._pool.closed

    def submit(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str | None]) -> Future:
        """Start scoring a batch; the future's result is a :class:`RewardResult` (or it raises :class:`RewardError`).

        In the main process (:attr:`in_process`) the batch is scored on the calling thread before this returns."""
        check_batch_lengths(reward_name(self.reward), prompts, completions, answers)
        if self._pool.in_process:
            fut: Future[RewardResult] = Future()
            try:
                fut.set_result(
                    _score_in_process(self.reward, list(prompts), list(completions), list(answers), self.config)
                )
            except Exception as e:  # delivered through the future, like the pool's errors
                fut.set_exception(e)
            return fut
        job = _Job(next(self._seq), list(prompts), list(completions), list(answers))
        self._pool.submit(job)
        return job.future

    def run(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str | None]) -> RewardResult:
        """Score a batch and wait for it."""
        return self.submit(prompts, completions, answers).result()

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str | None]) -> list[float]:
        """The batch's rewards only (:attr:`RewardResult.rewards`)."""
        return self.run(prompts, completions, answers).rewards

    def close(self) -> None:
        """Stop the workers; batches not yet scored fail with RuntimeError. Idempotent."""
        self._finalizer()

    def __enter__(self) -> RewardExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple:
        """Pickled (or deep-copied) as its reward and config; restored as the process's :func:`shared_executor` for
        them (a pool of processes cannot be copied)."""
        return shared_executor, (self.reward, self.config)

    def __repr__(self) -> str:
        where = "in process" if self.in_process else f"{self.workers} workers"
        return f"RewardExecutor({self.reward!r}, {where}, timeout_s={self.config.timeout_s})"


_SHARED: dict[tuple[bytes, tuple], RewardExecutor] = {}
_SHARED_LOCK = threading.Lock()


def shared_executor(reward: RewardFn, config: RewardConfig | None = None, **overrides: Any) -> RewardExecutor:
    """A process-wide executor for ``reward`` and these options: rewards that pickle to the same bytes share one pool
    (so repeated ``MathReward()`` calls or several modules start workers once). A reward that cannot be pickled gets a
    new in-process executor. Shared executors are closed at interpreter exit or by :func:`close_shared_executors`."""
    cfg = _merged_config(config, overrides)
    try:
        key = (pickle.dumps(reward), tuple(asdict(cfg).items()))
    except Exception:  # unpicklable: nothing to share; the executor warns and runs it in process
        return RewardExecutor(reward, cfg)
    with _SHARED_LOCK:
        ex = _SHARED.get(key)
        if ex is None or ex.closed:
            ex = _SHARED[key] = RewardExecutor(reward, cfg)
        return ex


def close_shared_executors() -> None:
    """Close every executor made by :func:`shared_executor` (their workers stop)."""
    with _SHARED_LOCK:
        executors = list(_SHARED.values())
        _SHARED.clear()
    for ex in executors:
        ex.close()


atexit.register(close_shared_executors)
