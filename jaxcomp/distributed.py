"""Multi-process (multi-host) jobs: start-up, the global mesh, checkpoints and
a cross-process consistency check.

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
* :class:`Checkpointer` saves and restores the whole train state with Orbax
  (parameters and optimizer state, compression state included: per-device
  residuals, PowerSGD Q, keys, counts), with metadata describing the
  compression configuration and the topology, validated on restore.
* :func:`check_consistency` fails loudly when processes (or devices) hold
  different copies of what must be identical: parameters and shared
  compressor state.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Environment variables set by ``python -m jaxcomp.launch`` (and readable by
# any other launcher that sets them).
ENV_COORDINATOR = "JAXCOMP_COORDINATOR_ADDRESS"  # "host:port" of process 0
ENV_NUM_PROCESSES = "JAXCOMP_NUM_PROCESSES"  # total number of processes
ENV_PROCESS_ID = "JAXCOMP_PROCESS_ID"  # this process, 0 .. n - 1
ENV_HEARTBEAT = "JAXCOMP_HEARTBEAT_TIMEOUT"  # seconds, optional

# Environment markers of the clusters whose parameters JAX detects itself.
_CLUSTER_MARKERS = ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri",
                    "TPU_WORKER_HOSTNAMES")

CHECKPOINT_FORMAT = 1


class ConsistencyError(RuntimeError):
  """Processes or devices hold different values of a leaf that must be
  identical everywhere (parameters, shared compressor state)."""


class CheckpointMismatchError(ValueError):
  """A checkpoint does not fit this run (compressor, tree, shapes, devices)."""


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


def _cluster_detected() -> bool:
  """Whether JAX's cluster auto-detection would find this job's parameters."""
  try:  # JAX's own list of cluster environments (SLURM, Open MPI, k8s, TPU).
    from jax._src.clusters import ClusterEnv  # pylint: disable=g-import-not-at-top
    return any(not env.opt_in_only_method and env.is_env_present()
               for env in ClusterEnv._cluster_types)  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except
    return any(m in os.environ for m in _CLUSTER_MARKERS)


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
      (no hang). Default: ``JAXCOMP_HEARTBEAT_TIMEOUT`` if set, else JAX's 100.
    shutdown_timeout_seconds: seconds a finishing process waits for the others
      at exit (JAX's default is 300; 30 here so that a job whose peer died
      ends sooner).

  Returns:
    True if ``jax.distributed`` was initialised (now or before), False for a
    single-process run.

  Raises:
    ValueError: an incomplete or inconsistent set of parameters (e.g. a
      ``process_id`` without ``num_processes``, or out of range).
  """
  if jax.distributed.is_initialized():
    return True
  address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
  if num_processes is None:
    num_processes = _env_int(ENV_NUM_PROCESSES)
  if process_id is None:
    process_id = _env_int(ENV_PROCESS_ID)
  if heartbeat_timeout_seconds is None:
    heartbeat_timeout_seconds = _env_int(ENV_HEARTBEAT) or 100
  if heartbeat_timeout_seconds < 1:
    raise ValueError("heartbeat_timeout_seconds must be >= 1, got "
                     f"{heartbeat_timeout_seconds=}")
  explicit = (address, num_processes, process_id)
  if any(v is not None for v in explicit):
    if any(v is None for v in explicit):
      raise ValueError(
          "a multi-process job needs coordinator_address, num_processes and "
          f"process_id together, got {address=}, {num_processes=}, "
          f"{process_id=}; pass all three (flags or {ENV_COORDINATOR}, "
          f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}) or none")
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ValueError(f"need 0 <= process_id < num_processes, got "
                       f"{process_id=}, {num_processes=}")
  elif not (cluster_detection_method or (auto_detect and _cluster_detected())):
    return False
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(
      coordinator_address=address, num_processes=num_processes,
      process_id=process_id, local_device_ids=local_device_ids,
      cluster_detection_method=cluster_detection_method,
      initialization_timeout=initialization_timeout,
      heartbeat_timeout_seconds=heartbeat_timeout_seconds,
      shutdown_timeout_seconds=shutdown_timeout_seconds)
  return True


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


def global_array(tree, mesh: Mesh, spec: P = P()):
  """Global arrays from host values that every process holds in full.

  Each process keeps only the shards of its own devices, so this works on
  multi-process meshes (where ``jax.device_put`` of a host array needs every
  device to be addressable). For data that each process holds only a part
  of, use ``jax.make_array_from_process_local_data``.

  Args:
    tree: a pytree of array-likes, identical on every process.
    mesh: the (global) mesh.
    spec: partition spec for every leaf, e.g. ``P()`` for parameters or
      ``P(("hosts", "devices"))`` for a batch.

  Returns:
    The pytree of ``jax.Array``s with ``NamedSharding(mesh, spec)``.
  """
  sharding = NamedSharding(mesh, spec)

  def put(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

  return jax.tree.map(put, tree)


# ---------------------------------------------------------------------------
# Consistency check


def _path_str(path) -> str:
  return jax.tree_util.keystr(path) or "<root>"


def _digest(x: np.ndarray) -> np.ndarray:
  x = np.ascontiguousarray(x)
  h = hashlib.blake2b(x.tobytes(), digest_size=16)
  h.update(str((x.shape, x.dtype.str)).encode())
  return np.frombuffer(h.digest(), dtype=np.uint32).copy()


def _host_value(shard) -> np.ndarray:
  data = shard.data
  if jax.dtypes.issubdtype(data.dtype, jax.dtypes.prng_key):
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
    tree: a pytree of global ``jax.Array``s.
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


# ---------------------------------------------------------------------------
# Checkpoints


def _spec_str(x) -> str:
  sharding = getattr(x, "sharding", None)
  if sharding is None or sharding.is_fully_replicated:
    return "P()"  # also P(None, None) and the like
  if isinstance(sharding, NamedSharding):
    return str(sharding.spec)
  return str(sharding)


def _mesh_of(tree) -> Mesh | None:
  for x in jax.tree.leaves(tree):
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
      return sharding.mesh
  return None


def describe(tree, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """The metadata saved next to a checkpoint of ``tree``.

  Returns:
    A JSON-serialisable dict: ``format``, ``config`` (the caller's
    description of the compression: compressor name and hyperparameters,
    bucketing, ...), ``process_count``, ``device_count``, ``mesh``
    (``{axis: size}``), and ``leaves``: per leaf its tree ``path``, ``shape``,
    ``dtype`` and partition ``spec`` (``P()`` for replicated leaves,
    ``P(axes)`` for per-device ones such as error-feedback residuals).
  """
  mesh = _mesh_of(tree)
  leaves = []
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    leaves.append({"path": _path_str(path), "shape": list(np.shape(x)),
                   "dtype": str(np.dtype(x.dtype)), "spec": _spec_str(x)})
  return {
      "format": CHECKPOINT_FORMAT,
      "config": json.loads(json.dumps(dict(config or {}))),
      "process_count": jax.process_count(),
      "device_count": int(mesh.devices.size) if mesh is not None else
                      jax.device_count(),
      "mesh": {str(k): int(v) for k, v in mesh.shape.items()} if mesh
              is not None else {},
      "leaves": leaves,
  }


def _per_device_leaves(meta, *, include_stats: bool = False) -> list[str]:
  """Paths of the leaves sharded over the mesh (one row per device).

  Per-device statistics (``CompressedMeanState.stats``, e.g. the residual
  norm) are left out unless ``include_stats``: every step overwrites them, so
  they never make a checkpoint topology-bound.
  """
  return [l["path"] for l in meta["leaves"] if l["spec"] != "P()" and (
      include_stats or ".stats." not in l["path"])]


def validate(saved: Mapping[str, Any], current: Mapping[str, Any],
             where: str = "checkpoint") -> None:
  """Raises :class:`CheckpointMismatchError` where ``saved`` metadata does
  not fit ``current`` (both from :func:`describe`), naming what differs."""
  if saved.get("format") != CHECKPOINT_FORMAT:
    raise CheckpointMismatchError(
        f"{where} has metadata format {saved.get('format')!r}, this jaxcomp "
        f"reads format {CHECKPOINT_FORMAT}")
  sc, cc = saved.get("config", {}), current.get("config", {})
  diffs = [f"{k}: {sc.get(k, '<absent>')!r} in the {where}, "
           f"{cc.get(k, '<absent>')!r} in this run"
           for k in sorted(set(sc) | set(cc)) if sc.get(k) != cc.get(k)]
  if diffs:
    raise CheckpointMismatchError(
        f"{where} was written with another compression configuration: "
        + "; ".join(diffs) + ". Restore it with the configuration it was "
        "saved with, or start a fresh run")
  per_device = _per_device_leaves(saved)
  if per_device and (saved["device_count"] != current["device_count"] or
                     saved["mesh"] != current["mesh"]):
    raise CheckpointMismatchError(
        f"{where} holds per-device compression state ({len(per_device)} "
        f"leaves, e.g. {per_device[0]}) for {saved['device_count']} devices "
        f"(mesh {saved['mesh']}), but this run has "
        f"{current['device_count']} devices (mesh {current['mesh']}). "
        "Error-feedback residuals belong to the device that accumulated "
        "them and are not resharded silently: restore onto the same "
        "topology, or pass on_topology_change='average' to give every new "
        "device the mean residual (the pending update is preserved, the "
        "per-device split is not)")
  sp = [l["path"] for l in saved["leaves"]]
  cp = [l["path"] for l in current["leaves"]]
  if sp != cp:
    missing = [p for p in sp if p not in cp]
    extra = [p for p in cp if p not in sp]
    raise CheckpointMismatchError(
        f"{where} has another state structure: {len(sp)} leaves there, "
        f"{len(cp)} here; only in the checkpoint: {missing[:5]}; only in "
        f"this run: {extra[:5]} (another compressor, error feedback setting, "
        "optimizer or model?)")
  diffs = [f"leaf {s['path']} is {s['dtype']}{s['shape']}, this run expects "
           f"{c['dtype']}{c['shape']}"
           for s, c in zip(saved["leaves"], current["leaves"])
           if s["shape"] != c["shape"] or s["dtype"] != c["dtype"]]
  if diffs:
    raise CheckpointMismatchError(
        f"{where} does not fit this run: " + "; ".join(diffs[:8])
        + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
        + " (another model, bucket size or compressor hyperparameter?)")


class Checkpointer:
  """Saves and restores a whole train state with Orbax, in single- and
  multi-process jobs.

  The state is any pytree of global ``jax.Array``s, typically ``{"params":
  params, "opt_state": opt_state, ...}`` with ``opt_state`` from
  :func:`jaxcomp.init_sharded`: per-device residuals (sharded ``P(axes)``,
  leading device axis) are saved shard by shard by the processes that own
  them; replicated leaves once. Next to it, :func:`describe`'s metadata
  (compression config, device count, mesh, leaf paths / shapes / dtypes /
  specs) is saved as JSON and checked by :meth:`restore` before any array is
  read.

  Saves are synchronous (the step is committed when :meth:`save` returns),
  and atomic: a process killed during a save leaves the previous checkpoints
  intact, and the half-written one is ignored.

  Every process must construct it and call :meth:`save` / :meth:`restore`
  with the same arguments; ``directory`` must be shared by all processes
  (a network file system on a real cluster).

  Args:
    directory: checkpoint root; created if absent.
    config: JSON-serialisable description of the compression (e.g.
      ``{"compressor": "topk", "ratio": 0.01, "error_feedback": True,
      "bucketing": "layerwise"}``); a checkpoint is only restored into a run
      with an equal ``config``.
    max_to_keep: keep only the newest checkpoints (None: keep all).

  Example::

    ckpt = jaxcomp.distributed.Checkpointer("/ckpt", config=config)
    ckpt.save(step, {"params": params, "opt_state": opt_state})
    step, state = ckpt.restore({"params": params, "opt_state": opt_state})
  """

  def __init__(self, directory: str | os.PathLike, *,
               config: Mapping[str, Any] | None = None,
               max_to_keep: int | None = None):
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    self._ocp = ocp
    self.directory = os.path.abspath(os.fspath(directory))
    self.config = json.loads(json.dumps(dict(config or {})))
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep=}")
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True,
            enable_async_checkpointing=False))

  def latest_step(self) -> int | None:
    """The newest committed step, or None when there is none."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """All committed steps, oldest first."""
    return sorted(self._manager.all_steps())

  def save(self, step: int, state) -> None:
    """Saves ``state`` as ``step`` (every process must call it).

    Raises:
      ValueError: ``step`` negative or already saved.
      TypeError: a leaf of ``state`` is not a ``jax.Array``.
    """
    step = int(step)
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step=}")
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
      if not isinstance(x, jax.Array):
        raise TypeError(
            f"state{_path_str(path)} is a {type(x).__name__}; save a pytree "
            "of jax.Arrays (put host values on the mesh with "
            "jaxcomp.distributed.global_array, or keep them in the config)")
    if step in self._manager.all_steps():
      raise ValueError(f"step {step} is already saved in {self.directory}")
    leaves = jax.tree.leaves(state)
    meta = describe(state, self.config)
    meta["step"] = step
    ocp = self._ocp
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({f"{i:05d}": x for i, x in
                                     enumerate(leaves)}),
        jaxcomp=ocp.args.JsonSave(meta)))
    self._manager.wait_until_finished()

  def metadata(self, step: int | None = None) -> dict[str, Any]:
    """The metadata saved with ``step`` (default: the newest).

    Raises:
      FileNotFoundError: no checkpoint (at that step).
    """
    step = self._resolve(step)
    ocp = self._ocp
    out = self._manager.restore(step, args=ocp.args.Composite(
        jaxcomp=ocp.args.JsonRestore()))
    return dict(out["jaxcomp"])

  def _resolve(self, step):
    steps = self._manager.all_steps()
    if step is None:
      step = self._manager.latest_step()
      if step is None:
        raise FileNotFoundError(f"no checkpoint in {self.directory}")
    elif step not in steps:
      raise FileNotFoundError(
          f"no checkpoint of step {step} in {self.directory}; saved steps: "
          f"{sorted(steps)}")
    return int(step)

  def restore(self, target, step: int | None = None, *,
              on_topology_change: str = "refuse"):
    """Restores a checkpoint into arrays shaped and sharded like ``target``.

    Args:
      target: a pytree of global ``jax.Array``s (or ``jax.ShapeDtypeStruct``s
        with shardings) with the structure of the saved state, e.g. the
        freshly initialised ``{"params": ..., "opt_state": ...}``; its
        shardings say where each restored leaf goes.
      step: the step to restore; default the newest.
      on_topology_change: what to do when the checkpoint holds per-device
        state (error-feedback residuals) for another number of devices or
        another mesh shape: ``"refuse"`` (default) raises
        :class:`CheckpointMismatchError`; ``"average"`` gives every device of
        this run the mean of the saved residuals (float32), which preserves
        the pending averaged update ``mean_i(e_i)`` that error feedback will
        still send, but not how it was split between devices, so the run
        does not continue bit-exactly. Replicated leaves are restored
        exactly in both cases.

    Returns:
      ``(step, state)``: bit-exact copies of the saved arrays, placed with
      ``target``'s shardings, in ``target``'s tree structure.

    Raises:
      FileNotFoundError: no checkpoint (at that step).
      CheckpointMismatchError: another compression config, tree structure,
        leaf shape or dtype, or (with ``"refuse"``) device topology; the
        message names what differs.
      ValueError: an unknown ``on_topology_change``.
    """
    if on_topology_change not in ("refuse", "average"):
      raise ValueError("on_topology_change must be 'refuse' or 'average', "
                       f"got {on_topology_change=}")
    step = self._resolve(step)
    saved = self.metadata(step)
    current = describe(target, self.config)
    where = f"checkpoint {self.directory} step {step}"
    per_device = set(_per_device_leaves(saved, include_stats=True))
    topology_changed = bool(per_device) and (
        saved.get("device_count") != current["device_count"] or
        saved.get("mesh") != current["mesh"])
    if topology_changed:
      # Per-device rows may differ in number; everything else must match.
      checked = {**current, "leaves": _with_shapes(
          current["leaves"], saved["leaves"], per_device)}
      if on_topology_change == "average":
        checked.update(device_count=saved["device_count"], mesh=saved["mesh"])
      validate(saved, checked, where)
    else:
      validate(saved, current, where)
    leaves, treedef = jax.tree.flatten(target)
    paths = [l["path"] for l in current["leaves"]]
    abstract = {}
    for i, (x, s) in enumerate(zip(leaves, saved["leaves"])):
      sharding = x.sharding
      shape = tuple(s["shape"])
      if topology_changed and paths[i] in per_device:
        # Read the old per-device rows whole (replicated), then average.
        sharding = NamedSharding(sharding.mesh, P())
      abstract[f"{i:05d}"] = jax.ShapeDtypeStruct(shape, x.dtype,
                                                  sharding=sharding)
    ocp = self._ocp
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))["state"]
    restored = []
    for i, x in enumerate(leaves):
      value = out[f"{i:05d}"]
      if topology_changed and paths[i] in per_device:
        value = _average_rows(value, x)
      restored.append(value)
    return step, jax.tree.unflatten(treedef, restored)

  def close(self) -> None:
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _with_shapes(current_leaves, saved_leaves, per_device):
  """``current_leaves`` with the saved shapes of the per-device leaves (whose
  leading device axis may differ), for validating everything else."""
  out = []
  for c, s in zip(current_leaves, saved_leaves):
    if c["path"] in per_device and c["path"] == s["path"] and (
        c["shape"][1:] == s["shape"][1:]):
      c = {**c, "shape": s["shape"]}
    out.append(c)
  return out


def _average_rows(value: jax.Array, like) -> jax.Array:
  """Mean over the saved leading device axis, repeated for ``like``'s."""
  host = np.asarray(value.addressable_shards[0].data)
  mean = np.mean(host.astype(np.float64), axis=0).astype(host.dtype)
  full = np.broadcast_to(mean, like.shape)
  return jax.make_array_from_callback(like.shape, like.sharding,
                                      lambda i: np.ascontiguousarray(full[i]))
