"""Multi-process (multi-host) jobs: start-up, the global mesh, global arrays
and a cross-process consistency check (checkpoints: :mod:`jaxcomp.checkpoint`).

A multi-host job runs one Python process per host (or per GPU); they meet
through ``jax.distributed.initialize`` and then see one global list of
devices. Everything in jaxcomp then works unchanged on a mesh built from those
devices (:func:`global_mesh`): ``init_sharded``, ``shard_train_step`` and
``compressed_mean`` see global arrays, and each process holds only the shards
of its own devices.

* :func:`initialize_from_env` joins the job: explicit arguments, else the
  ``JAXCOMP_*`` variables that :mod:`jaxcomp.launch` sets, else JAX's own
  cluster auto-detection (SLURM, Open MPI, Kubernetes, Cloud TPU), else a
  plain single-process run.
* :func:`global_mesh` builds the ``("hosts", "devices")`` mesh, so that
  compression can be applied over the slow axis only.
* :func:`global_array` puts host values every process holds on the mesh.
* :func:`check_consistency` fails loudly when processes (or devices) hold
  different copies of what must be identical: parameters and shared
  compressor state.
* a peer watcher (started by :func:`initialize_from_env`): when a process of
  the job dies, every survivor exits on its own with one line naming it and
  the last complete checkpoint (:data:`PEER_LOST_EXIT_CODE`), instead of
  hanging in a collective or being aborted by JAX's coordination service.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import numbers
import os
import sys
import threading
import time
from typing import Any
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Environment variables set by ``python -m jaxcomp.launch`` (and readable by
# any other launcher that sets them).
ENV_COORDINATOR = "JAXCOMP_COORDINATOR_ADDRESS"  # "host:port" of process 0
ENV_NUM_PROCESSES = "JAXCOMP_NUM_PROCESSES"  # total number of processes
ENV_PROCESS_ID = "JAXCOMP_PROCESS_ID"  # this process, 0 .. n - 1
ENV_HEARTBEAT = "JAXCOMP_HEARTBEAT_TIMEOUT"  # seconds, optional
ENV_WATCH_PEERS = "JAXCOMP_WATCH_PEERS"  # "0" turns the peer watcher off
# Seconds of silence after which JAX declares a process dead and stops the
# others (JAX's own default is 100).
DEFAULT_HEARTBEAT_TIMEOUT = 10

# Environment markers of the clusters whose parameters JAX's
# jax.distributed.initialize() detects itself (JAX 0.10: SLURM, Open MPI,
# Cloud TPU and GKE TPU slices, Kubernetes pods of an indexed job). Read from
# the environment, not from JAX's private cluster registry.
_CLUSTER_MARKERS = ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri",
                    "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
                    "MEGASCALE_COORDINATOR_ADDRESS", "JOB_COMPLETION_INDEX")


class ConsistencyError(RuntimeError):
  """Processes or devices hold different values of a leaf that must be
  identical everywhere (parameters, shared compressor state)."""


class AgreementError(ConsistencyError):
  """The processes of a job were started with different configurations (a
  transform hyperparameter, a state shape, the mesh): found before the first
  exchange, instead of a collective that aborts or silently diverges."""


# ---------------------------------------------------------------------------
# Start-up


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"environment variable {name}={value!r} must be an "
                     "integer") from None


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _cluster_detected() -> bool:
  """Whether this looks like a cluster job whose parameters JAX's own
  auto-detection finds (one of :data:`_CLUSTER_MARKERS` is set)."""
  return any(m in os.environ for m in _CLUSTER_MARKERS)


def check_address(address: str) -> None:
  """Raises ValueError unless ``address`` is ``"host:port"`` with a port in
  1..65535 (the form ``jax.distributed.initialize`` takes)."""
  host, sep, port = str(address).rpartition(":")
  if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
    raise ValueError(
        f"coordinator address must be 'host:port' with a port in 1..65535, "
        f"got {address!r} (from the argument or {ENV_COORDINATOR})")


def initialize_from_env(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: int | Sequence[int] | None = None,
    cluster_detection_method: str | None = None,
    auto_detect: bool = True,
    cpu_collectives: str | None = "gloo",
    initialization_timeout: int = 300,
    heartbeat_timeout_seconds: int | None = None,
    shutdown_timeout_seconds: int = 30,
    watch_peers: bool | None = None,
) -> bool:
  """Joins a multi-process JAX job, if this process is part of one.

  Call it first, before any other JAX call. Where the job's parameters come
  from, first match wins:

  1. the arguments (e.g. from ``--coordinator-address``, ``--num-processes``,
     ``--process-id`` flags);
  2. ``JAXCOMP_COORDINATOR_ADDRESS`` / ``JAXCOMP_NUM_PROCESSES`` /
     ``JAXCOMP_PROCESS_ID``, as set by ``python -m jaxcomp.launch``;
  3. JAX's cluster auto-detection (``jax.distributed.initialize()`` with no
     address: SLURM, Open MPI, Kubernetes, Cloud TPU), when
     ``cluster_detection_method`` is given or such an environment is present
     and ``auto_detect`` is True;
  4. none of these: a single-process run; nothing is initialised.

  Args:
    coordinator_address: ``"host:port"`` of process 0's coordinator.
    num_processes: number of processes in the job.
    process_id: this process's index, ``0 <= process_id < num_processes``.
    local_device_ids: restricts this process to these local devices (e.g. one
      GPU per process).
    cluster_detection_method: forces a JAX cluster environment by name
      (e.g. ``"slurm"``, ``"mpi4py"``).
    auto_detect: allow step 3.
    cpu_collectives: CPU cross-process collectives, ``"gloo"`` (default) or
      ``"mpi"``; None leaves JAX's setting. GPU jobs use NCCL regardless.
    initialization_timeout: seconds to wait for all processes to join.
    heartbeat_timeout_seconds: a process that has sent no heartbeat for this
      long is declared dead and the job is stopped on every surviving process
      (no hang). Default: ``JAXCOMP_HEARTBEAT_TIMEOUT`` if set, else
      ``DEFAULT_HEARTBEAT_TIMEOUT`` (10 s, against JAX's 100 s: a survivor
      stuck in a collective with a dead peer then stops within about 10 s).
    shutdown_timeout_seconds: seconds a finishing process waits for the others
      at exit (JAX's default is 300; 30 here so that a job whose peer died
      ends sooner).
    watch_peers: run the peer watcher (see :func:`watching_peers`): when
      another process dies, this one writes one line naming it and the last
      complete checkpoint to stderr and exits with
      :data:`PEER_LOST_EXIT_CODE`, within ``heartbeat_timeout_seconds`` plus
      about a second, instead of hanging in a collective or being aborted
      by JAX (SIGABRT and a C++ stack trace). Default: on, unless
      ``JAXCOMP_WATCH_PEERS=0``. It needs Orbax (``pip install
      jaxcomp[checkpoint]``) for the barrier at exit; without Orbax the
      default is off. Off, a dead process makes JAX abort the others after
      ``heartbeat_timeout_seconds``.

  Returns:
    True if ``jax.distributed`` was initialised (now or before), False for a
    single-process run.

  Raises:
    ValueError: an incomplete or inconsistent set of parameters (e.g. a
      ``process_id`` without ``num_processes``, or out of range), or a
      coordinator address that is not ``host:port``.
    ImportError: ``watch_peers=True`` without Orbax installed.
  """
  if jax.distributed.is_initialized():
    return True
  watch = _want_watch(watch_peers)
  address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
  if num_processes is None:
    num_processes = _env_int(ENV_NUM_PROCESSES)
  if process_id is None:
    process_id = _env_int(ENV_PROCESS_ID)
  if heartbeat_timeout_seconds is None:
    heartbeat_timeout_seconds = _env_int(ENV_HEARTBEAT)
    if heartbeat_timeout_seconds is None:
      heartbeat_timeout_seconds = DEFAULT_HEARTBEAT_TIMEOUT
  if not _is_int(heartbeat_timeout_seconds) or heartbeat_timeout_seconds < 1:
    raise ValueError("heartbeat_timeout_seconds must be an integer >= 1, "
                     f"got {heartbeat_timeout_seconds=!r}")
  if address is not None:
    check_address(address)
  explicit = (address, num_processes, process_id)
  if any(v is not None for v in explicit):
    if any(v is None for v in explicit):
      raise ValueError(
          "a multi-process job needs coordinator_address, num_processes and "
          f"process_id together, got {address=}, {num_processes=}, "
          f"{process_id=}; pass all three (flags or {ENV_COORDINATOR}, "
          f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}) or none")
    assert num_processes is not None and process_id is not None  # just above
    if not (_is_int(num_processes) and _is_int(process_id)):
      raise ValueError(f"num_processes and process_id must be integers, got "
                       f"{num_processes=!r}, {process_id=!r}")
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(f"need 0 <= process_id < num_processes, got "
                       f"{process_id=}, {num_processes=}")
    # JAX takes Python ints only (a NumPy integer is refused there).
    num_processes, process_id = int(num_processes), int(process_id)
  elif not (cluster_detection_method or (auto_detect and _cluster_detected())):
    return False
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  # With the watcher, JAX's coordination service must not abort the
  # survivors itself when a process dies (JAX's recoverability flag): the
  # watcher stops them, in its own words.
  if watch:
    jax.config.update("jax_enable_recoverability", True)
  jax.distributed.initialize(
      coordinator_address=address, num_processes=num_processes,
      process_id=process_id, local_device_ids=local_device_ids,
      cluster_detection_method=cluster_detection_method,
      initialization_timeout=initialization_timeout,
      heartbeat_timeout_seconds=heartbeat_timeout_seconds,
      shutdown_timeout_seconds=shutdown_timeout_seconds)
  if watch and jax.process_count() > 1:
    _start_watch(heartbeat_timeout_seconds, shutdown_timeout_seconds)
  return True


# ---------------------------------------------------------------------------
# Peer watcher

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


def _want_watch(watch_peers: bool | None) -> bool:
  """Whether to run the peer watcher (see :func:`watching_peers`)."""
  has_orbax = importlib.util.find_spec("orbax") is not None and (
      importlib.util.find_spec("orbax.checkpoint") is not None)
  if watch_peers is None:
    off = os.environ.get(ENV_WATCH_PEERS, "").strip().lower()
    return has_orbax and off not in ("0", "false", "no", "off")
  if watch_peers and not has_orbax:
    raise ImportError(
        "watch_peers=True needs Orbax for its barrier at exit: pip install "
        "'jaxcomp[checkpoint]' (or orbax-checkpoint), or pass "
        "watch_peers=False")
  return bool(watch_peers)


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


# ---------------------------------------------------------------------------
# Preemption

_TERM_SIGNALS: list[int] = []


def _note_sigterm(signum, frame):
  del frame
  _TERM_SIGNALS.append(signum)


def preemption_requested(step: int) -> bool:
  """Whether to checkpoint and stop now, the same answer on every process.

  A scheduler preempts a job with SIGTERM (to one process, or to the
  launcher, which forwards it). In a multi-process job JAX catches SIGTERM
  in every process and agrees, in the background, on the step at which all
  of them stop (``jax.experimental.multihost_utils.
  reached_preemption_sync_point``): this returns True on every process at
  that same step. In a single-process run it returns True once the process
  got SIGTERM (the first call installs the handler).

  Call it at every step, with the step about to run (every process from the
  same step), save a checkpoint when it returns True and exit 0; resuming
  from that checkpoint is bit-exact (``examples/multihost/train_mlp.py``).

  Args:
    step: the step number, increasing by one per call.

  Returns:
    True when the job must stop at this step.
  """
  if jax.distributed.is_initialized():
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return bool(multihost_utils.reached_preemption_sync_point(int(step)))
  import signal  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  if (signal.getsignal(signal.SIGTERM) is not _note_sigterm
      and threading.current_thread() is threading.main_thread()):
    signal.signal(signal.SIGTERM, _note_sigterm)
  return bool(_TERM_SIGNALS)


# ---------------------------------------------------------------------------
# Mesh and global arrays


def global_mesh(axis_names: Sequence[str] = ("hosts", "devices")) -> Mesh:
  """A mesh over every device of every process.

  Args:
    axis_names: two names ``(slow, fast)``: shape ``(process_count,
      local_device_count)``, row ``i`` holding process ``i``'s devices, so an
      exact ``psum`` can run over the fast (in-host) axis and compression
      over the slow (cross-host) one; or one name: a flat mesh of all
      devices in process order.

  Returns:
    A ``jax.sharding.Mesh`` with Explicit axes (as ``jax.make_mesh``).

  Raises:
    ValueError: not one or two distinct names, or processes with different
      numbers of devices.
  """
  names = tuple(axis_names)
  if len(names) not in (1, 2) or len(set(names)) != len(names) or not all(
      isinstance(n, str) and n for n in names):
    raise ValueError("axis_names must be one or two distinct non-empty "
                     f"names, e.g. ('hosts', 'devices'), got {axis_names=}")
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  counts = {}
  for d in devices:
    counts[d.process_index] = counts.get(d.process_index, 0) + 1
  if len(set(counts.values())) != 1:
    raise ValueError(f"processes have different device counts {counts}; a "
                     "('hosts', 'devices') mesh needs the same number on each")
  shape = ((len(devices),) if len(names) == 1 else
           (len(counts), len(devices) // len(counts)))
  explicit = jax.sharding.AxisType.Explicit
  return Mesh(np.asarray(devices, dtype=object).reshape(shape), names,
              axis_types=(explicit,) * len(names))


def global_array(tree, mesh: Mesh, spec: P = P(), *,
                 process_local: bool = False):
  """Global arrays from host values, on a single- or multi-process mesh.

  Each process keeps only the shards of its own devices, so this works on
  multi-process meshes (where ``jax.device_put`` of a host array needs every
  device to be addressable).

  Args:
    tree: a pytree of array-likes: identical on every process, or with
      ``process_local`` this process's part (e.g. its share of a batch).
    mesh: the (global) mesh.
    spec: partition spec for every leaf, e.g. ``P()`` for parameters or
      ``P(("hosts", "devices"))`` for a batch.
    process_local: each process holds only its own rows of the leaves
      (``jax.make_array_from_process_local_data``), not all of them.

  Returns:
    The pytree of ``jax.Array``s with ``NamedSharding(mesh, spec)``.
  """
  sharding = NamedSharding(mesh, spec)

  def put(x):
    x = np.asarray(x)
    if process_local:
      return jax.make_array_from_process_local_data(sharding, x)
    return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

  return jax.tree.map(put, tree)


# ---------------------------------------------------------------------------
# Agreement and consistency checks

_AGREEMENT_SLOTS = 256  # items compared one by one; the rest as one digest


def check_agreement(items, *, what: str = "configuration") -> int:
  """Checks that every process has the same ``items``, with one small
  all-gather (``(_AGREEMENT_SLOTS + 1) x 16`` bytes per process).

  Every process must call it with a list of the same length and order
  (``(name, value)`` pairs, value a string); a process with another length
  is a difference too.

  Returns:
    The number of items compared.

  Raises:
    AgreementError: on every process, naming the first item whose value
      differs, this process's value, and which processes differ from it.
  """
  items = [(str(k), str(v)) for k, v in items]
  slots = np.zeros((_AGREEMENT_SLOTS + 1, 4), np.uint32)
  slots[0, 0] = len(items)
  rest = hashlib.blake2b(digest_size=16)
  for i, (k, v) in enumerate(items):
    h = np.frombuffer(hashlib.blake2b(f"{k}={v}".encode(), digest_size=16)
                      .digest(), np.uint32)
    if i < _AGREEMENT_SLOTS:
      slots[1 + i] = h
    else:
      rest.update(h.tobytes())
  if len(items) > _AGREEMENT_SLOTS:
    slots[_AGREEMENT_SLOTS] = np.frombuffer(rest.digest(), np.uint32)
  if jax.process_count() == 1:
    return len(items)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  every = np.asarray(multihost_utils.process_allgather(slots))
  me = jax.process_index()
  for row in range(slots.shape[0]):
    differ = [p for p in range(every.shape[0])
              if not np.array_equal(every[p, row], every[me, row])]
    if not differ:
      continue
    if row == 0:
      raise AgreementError(
          f"process {me} has {len(items)} {what} items, processes {differ} "
          "another number: the processes were started with different "
          "models or transforms; start every process with the same "
          "configuration")
    name, value = (items[row - 1] if row <= min(len(items), _AGREEMENT_SLOTS)
                   else ("the items after the first "
                         f"{_AGREEMENT_SLOTS}", "..."))
    raise AgreementError(
        f"the processes disagree on their {what}: {name} is {value} on "
        f"process {me} but differs on processes {differ}. Start every "
        "process with the same configuration (a difference here would "
        "otherwise crash a collective or let the processes diverge)")
  return len(items)


def _path_str(path) -> str:
  return jax.tree_util.keystr(path) or "<root>"


def _digest(x: np.ndarray) -> np.ndarray:
  x = np.ascontiguousarray(x)
  h = hashlib.blake2b(x.tobytes(), digest_size=16)
  h.update(str((x.shape, x.dtype.str)).encode())
  return np.frombuffer(h.digest(), dtype=np.uint32).copy()


def _host_value(shard) -> np.ndarray:
  data = shard.data
  if jnp.issubdtype(data.dtype, jax.dtypes.prng_key):
    data = jax.random.key_data(data)
  return np.asarray(data)


def check_consistency(tree, *, name: str = "state") -> int:
  """Checks that every replicated leaf is identical on all devices and
  processes.

  Call it (opt-in, e.g. every N steps) on ``{"params": params, "opt_state":
  opt_state}``: parameters, the inner optimizer's moments and the shared
  compressor state (shared PRNG key, PowerSGD Q, counts) are replicated
  (``P()``) and must be bit-identical everywhere; a difference means the
  processes diverged. Per-device leaves (error-feedback residuals, sharded
  with ``P(axes)``) legitimately differ and are skipped.

  Every process must call it (it exchanges one 16-byte digest per leaf
  between processes).

  Args:
    tree: a pytree of global arrays (``jax.Array``).
    name: how to call ``tree`` in error messages.

  Returns:
    The number of leaves checked.

  Raises:
    ConsistencyError: naming the first leaf (by tree path) whose copies
      differ, and the processes or devices holding the differing copies.
  """
  flat = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
          if isinstance(x, jax.Array) and x.sharding.is_fully_replicated]
  digests = np.zeros((len(flat), 4), np.uint32)
  for i, (path, x) in enumerate(flat):
    shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
    local = [_digest(_host_value(s)) for s in shards]
    for s, d in zip(shards[1:], local[1:]):
      if not np.array_equal(d, local[0]):
        raise ConsistencyError(
            f"{name}{_path_str(path)} differs between devices "
            f"{shards[0].device} and {s.device} of process "
            f"{jax.process_index()}; replicated values must be identical on "
            "every device")
    digests[i] = local[0]
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    every = np.asarray(multihost_utils.process_allgather(digests))
  else:
    every = digests[None]
  for i, (path, _) in enumerate(flat):
    groups: dict[bytes, list[int]] = {}
    for proc in range(every.shape[0]):
      groups.setdefault(every[proc, i].tobytes(), []).append(proc)
    if len(groups) > 1:
      parts = "; ".join(f"value {j} on processes {procs}"
                        for j, procs in enumerate(groups.values()))
      raise ConsistencyError(
          f"{name}{_path_str(path)} diverged across processes: {len(groups)} "
          f"different values ({parts}). Parameters and "
          "shared compressor state must be identical on every process; "
          "check that every process feeds the same global batch, seed and "
          "configuration")
  return len(flat)
