"""Joining a multi-process job: explicit arguments, the ``JAXCOMP_*``
variables that :mod:`jaxcomp.launch` sets, or JAX's cluster auto-detection
(:func:`initialize_from_env`); it starts the peer watcher
(:mod:`jaxcomp.distributed._watch`)."""

from __future__ import annotations

import importlib.util
import numbers
import os
from collections.abc import Sequence

import jax

from jaxcomp.distributed._watch import _start_watch

# Environment variables set by ``jaxcomp launch`` (and readable by
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
     ``JAXCOMP_PROCESS_ID``, as set by ``jaxcomp launch``;
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
