"""The peer watcher: when a process of the job dies, every survivor exits
on its own with one line naming it and the last complete checkpoint
(:data:`PEER_LOST_EXIT_CODE`); and leaving a job (:func:`shutdown`)."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Any
from collections.abc import Callable, Sequence

import jax

# Exit status of a survivor that lost a peer: EX_TEMPFAIL of sysexits.h
# ("temporary failure; the user is invited to retry"), so that a scheduler
# or wrapper can tell it from a crash and requeue the job from the last
# checkpoint.
PEER_LOST_EXIT_CODE = 75
_POLL_SECONDS = 0.5  # between two liveness queries


class _Watch:
  """The peer watcher's state (one per process)."""

  def __init__(self):
    self.lock = threading.Lock()
    self.thread: threading.Thread | None = None
    self.stop = threading.Event()
    self.heartbeat = 0  # seconds, JAX's heartbeat timeout
    self.shutdown_timeout = 0  # seconds, the barrier at exit
    self.checkpoint: tuple[int, str] | None = None  # (step, where)
    self.left = False  # this process passed its barrier at exit
    self.failed = False  # an uncaught exception is ending this process
    # Orbax's barrier, imported when the watcher starts: at exit, importing
    # Orbax (uvloop's thread pool) fails with "can't register atexit after
    # shutdown".
    self.barrier: Callable[..., Any] | None = None
    self.exit_wait: _ExitWait | None = None  # process 0's wait at exit


_WATCH = _Watch()


def _orbax_barrier():
  """Orbax's public coordination-service barrier
  (``orbax.checkpoint.multihost.get_barrier_sync_fn``), or None without
  Orbax (JAX itself exposes no barrier outside the devices)."""
  try:
    from orbax.checkpoint import multihost  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return multihost.get_barrier_sync_fn()


def watching_peers() -> bool:
  """Whether this process runs the peer watcher.

  The watcher is a daemon thread started by :func:`initialize_from_env` in a
  job of two or more processes. Every ``0.5`` s it asks JAX's coordination
  service which processes are alive
  (``jax.experimental.multihost_utils.live_devices``; the service declares
  a process dead when it has sent no heartbeat for
  ``heartbeat_timeout_seconds``). When one is not, it writes one line to
  stderr, e.g.::

    jaxcomp: process 1 of 2 stopped answering (JAX's coordination service
    lost its heartbeat, timeout 10 s); the last complete checkpoint is step 5
    (/ckpt); stopping process 0 with exit status 75

  and ends this process at once (``os._exit``) with
  :data:`PEER_LOST_EXIT_CODE`, whatever the main thread is doing (e.g.
  waiting in a collective for the dead process, which would otherwise never
  return). When the main thread fails first, with a
  ``jax.errors.JaxRuntimeError`` (gloo's "Connection reset by peer"), the
  traceback waits up to the heartbeat timeout for the watcher's verdict:
  the process then ends with the line alone. The checkpoint named is the
  newest one this process saved or restored with
  :class:`jaxcomp.checkpoint.Checkpointer` (or noted with
  :func:`note_checkpoint`).

  A normal exit stops the watcher and waits (up to
  ``shutdown_timeout_seconds``) at a barrier for every other process to
  finish too, so that a process that finishes first is not taken for a dead
  one; call :func:`shutdown` rather than ``jax.distributed.shutdown()`` to
  leave a job before the interpreter exits. A process ending with an
  uncaught exception leaves at once, and the others stop within a second.

  Limits: when process 0 (the coordinator, which hosts JAX's coordination
  service) dies, JAX aborts the others itself, at once, with its own message
  and a C++ stack trace (no public JAX hook runs code first). The watcher
  uses the JAX coordination service's liveness query: do not use
  ``jax.experimental.multihost_utils.live_devices`` in your own code beside
  it (pass ``watch_peers=False``).
  """
  return _WATCH.thread is not None and not _WATCH.stop.is_set()


def note_checkpoint(step: int, where: str) -> None:
  """Records that checkpoint ``step`` in ``where`` is complete, for the line
  the peer watcher writes when a process dies (``Checkpointer.save`` and
  ``restore`` call it; call it yourself for checkpoints of your own)."""
  with _WATCH.lock:
    if _WATCH.checkpoint is None or int(step) >= _WATCH.checkpoint[0]:
      _WATCH.checkpoint = (int(step), str(where))


def _lost(processes: Sequence[int] | None, why: str) -> None:
  """Writes the one line and ends this process (never returns)."""
  with _WATCH.lock:
    if _WATCH.stop.is_set():
      return
    ckpt = _WATCH.checkpoint
  me, n = jax.process_index(), jax.process_count()
  who = ("process 0's coordination service" if processes is None else
         f"process {processes[0]} of {n}" if len(processes) == 1 else
         f"processes {list(processes)} of {n}")
  where = (f"the last complete checkpoint is step {ckpt[0]} ({ckpt[1]})"
           if ckpt else "no checkpoint was saved or restored by this process")
  line = (f"jaxcomp: {who} stopped answering ({why}); {where}; "
          f"stopping process {me} with exit status {PEER_LOST_EXIT_CODE}\n")
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # pylint: disable=broad-except
      pass
  os.write(2, line.encode())
  os._exit(PEER_LOST_EXIT_CODE)  # pylint: disable=protected-access


class _Liveness:
  """Which processes JAX's coordination service counts as alive.

  Each :meth:`query` is one ``jax.experimental.multihost_utils.live_devices``
  block on an instance of its own (so that the state it keeps is not shared
  with a ``live_devices`` of the user's): a barrier among the live
  processes, which returns once each of them has made the same query, or
  has been declared dead (no heartbeat for the heartbeat timeout) or has
  disconnected.
  """

  def __init__(self):
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    self._failure = multihost_utils.ProcessFailureError
    self._tracker = type(multihost_utils.live_devices)()
    self._devices = jax.devices()
    self.alive: set[int] | None = None

  def query(self) -> set[int]:
    """The indices of the live processes (raises what JAX raises when the
    coordination service cannot be reached)."""
    try:
      with self._tracker(self._devices) as alive:
        if self.alive is None:
          self.alive = {d.process_index for d in alive}
    except self._failure as e:
      # Raised as the block exits: its body has set self.alive.
      assert self.alive is not None
      self.alive -= {d.process_index for d in e.failed_devices}
    return set(self.alive)


def _watch_loop(stop: threading.Event, heartbeat: int) -> None:
  everyone = set(range(jax.process_count()))
  why = (f"JAX's coordination service lost its heartbeat, timeout "
         f"{heartbeat} s")
  try:
    liveness = _Liveness()
  except Exception:  # pylint: disable=broad-except
    return  # no liveness query in this JAX: JAX's own abort remains
  while not stop.is_set():
    try:
      missing = sorted(everyone - liveness.query())
    except Exception as e:  # pylint: disable=broad-except
      if stop.is_set() or not jax.distributed.is_initialized():
        return  # shut down under us: nothing to watch
      _lost(None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
      return
    if missing and not stop.is_set():
      _lost(missing, why)
      return
    stop.wait(_POLL_SECONDS)


class _ExitWait:
  """Process 0 hosts JAX's coordination service: at exit it waits until the
  others have disconnected from it, since one whose disconnection finds the
  service gone is aborted by JAX. The waiting thread is started with the
  watcher, not at exit: Python 3.12 refuses to start a thread at
  interpreter shutdown ("can't create new thread at interpreter
  shutdown")."""

  def __init__(self):
    self.go = threading.Event()
    self.done = threading.Event()
    self.thread = threading.Thread(target=self._run, name="jaxcomp-exit-wait",
                                   daemon=True)
    self.thread.start()

  def _run(self):
    self.go.wait()
    try:
      me = jax.process_index()
      liveness = _Liveness()
      while liveness.query() - {me}:
        time.sleep(0.05)
    except Exception:  # pylint: disable=broad-except
      pass  # the service is gone or unreachable: nothing left to wait for
    finally:
      self.done.set()

  def wait(self, seconds: float) -> None:
    """Waits (up to ``seconds``) until the other processes have left."""
    self.go.set()
    self.done.wait(max(seconds, 0.0))


def _note_uncaught(hook):
  """``sys.excepthook`` that notes an uncaught exception (the process then
  leaves at once at exit) and, for a failed computation
  (``jax.errors.JaxRuntimeError``: gloo's "Connection reset by peer" when a
  peer died mid-collective), first gives the watcher the heartbeat timeout
  to name the lost process: then the job ends with that one line, not a
  traceback."""
  def excepthook(exc_type, exc, tb):
    _WATCH.failed = True
    runtime = getattr(jax.errors, "JaxRuntimeError", ())
    thread = _WATCH.thread
    if (runtime and isinstance(exc_type, type) and issubclass(exc_type, runtime)
        and thread is not None and not _WATCH.stop.is_set()):
      thread.join(_WATCH.heartbeat + 4 * _POLL_SECONDS)
    hook(exc_type, exc, tb)
  return excepthook


def _start_watch(heartbeat: int, shutdown_timeout: int) -> None:
  with _WATCH.lock:
    if _WATCH.thread is not None:
      return
    _WATCH.heartbeat, _WATCH.shutdown_timeout = heartbeat, shutdown_timeout
    _WATCH.barrier = _orbax_barrier()
    if jax.process_index() == 0:
      _WATCH.exit_wait = _ExitWait()
    _WATCH.thread = threading.Thread(
        target=_watch_loop, args=(_WATCH.stop, heartbeat),
        name="jaxcomp-peer-watch", daemon=True)
  sys.excepthook = _note_uncaught(sys.excepthook)
  # Registered after JAX's own exit handler (which disconnects from the
  # coordination service), so it runs before it.
  atexit.register(_leave)
  _WATCH.thread.start()


def _leave() -> None:
  """Stops the watcher and, on a normal exit, waits for every process at a
  barrier (JAX's recoverable mode has none at exit), so that no process
  leaves while the others may still take its exit for a death."""
  with _WATCH.lock:
    if _WATCH.thread is None or _WATCH.left:
      return
    _WATCH.stop.set()
    _WATCH.left = True
  if _WATCH.failed or not jax.distributed.is_initialized():
    return  # leave at once: the others' watchers stop them
  deadline = time.monotonic() + _WATCH.shutdown_timeout
  barrier = _WATCH.barrier
  if barrier is None:
    return
  try:
    barrier(key="jaxcomp_exit", timeout_ms=1000 * _WATCH.shutdown_timeout)
  except Exception:  # pylint: disable=broad-except
    pass  # a process is gone or late: the others' watchers tell
  if _WATCH.exit_wait is not None:
    _WATCH.exit_wait.wait(deadline - time.monotonic())


def shutdown() -> None:
  """Leaves the multi-process job: stops the peer watcher, waits for the
  other processes at a barrier (up to ``shutdown_timeout_seconds``), then
  ``jax.distributed.shutdown()``. Use it instead of
  ``jax.distributed.shutdown()`` to leave before the interpreter exits
  (which does the same by itself)."""
  _leave()
  if jax.distributed.is_initialized():
    jax.distributed.shutdown()
