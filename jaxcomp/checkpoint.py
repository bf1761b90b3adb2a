"""Checkpoints of the whole train state, compression state included.

:class:`Checkpointer` saves and restores parameters and optimizer state with
Orbax in single- and multi-process jobs (per-device residuals, PowerSGD Q,
keys, counts), with metadata describing the compression configuration and
the topology (:func:`describe`), checked on restore (:func:`validate`)
before any array is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from typing import Any, cast
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxcomp import distributed
from jaxcomp.distributed import _path_str
from jaxcomp.combinators import MultiStepsState
from jaxcomp.transform import CompressedMeanState
from jaxcomp.transform import CompressionStats
from jaxcomp.transform import transform_configs

# 2: leaves carry a "stats" flag (statistics are found by type).
# 3: a compressed_mean state's configuration is static data of the tree
#    (no "config" digest leaf); format 2 checkpoints still restore.
CHECKPOINT_FORMAT = 3
READABLE_FORMATS = (2, 3)


class CheckpointMismatchError(ValueError):
  """A checkpoint does not fit this run (compressor, tree, shapes, devices)."""


class CheckpointDamagedError(RuntimeError):
  """A checkpoint's files are missing or not as they were written (a
  process's shard deleted or truncated)."""


_INTEGRITY = "jaxcomp_integrity"  # per step: process_<i>.json, each file's
#                                   size and content digest


def _digest_file(path: str) -> str:
  """A 128-bit BLAKE2b digest of the file's bytes (hex)."""
  h = hashlib.blake2b(digest_size=16)
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _owner(rel: str) -> int:
  """The process whose data a file of Orbax's layout is (``..process_<i>``
  in its path); shared files are process 0's."""
  for part in rel.split(os.sep):
    head, sep, index = part.rpartition("process_")
    if sep and index.isdigit():
      return int(index)
  return 0


def _listing(step_dir: str, process: int) -> dict[str, int]:
  """``{path: bytes}`` of the files of ``process``'s data in a step."""
  out = {}
  for root, _, files in os.walk(step_dir):
    for f in files:
      rel = os.path.relpath(os.path.join(root, f), step_dir)
      if not rel.startswith(_INTEGRITY) and _owner(rel) == process:
        out[rel] = os.path.getsize(os.path.join(step_dir, rel))
  return out


def _record(step_dir: str, process: int) -> dict[str, list]:
  """``{path: [bytes, digest]}`` of the files of ``process``'s data in a
  step: what :meth:`Checkpointer.save` records and :meth:`damage` checks
  (a size alone let a file overwritten with other bytes of the same length
  pass, and restore other values or fail inside Orbax)."""
  return {rel: [size, _digest_file(os.path.join(step_dir, rel))]
          for rel, size in _listing(step_dir, process).items()}


def _stats_paths(tree) -> set[str]:
  """Paths of the leaves that are statistics (inside a
  :class:`jaxcomp.CompressionStats`): rewritten every step, so they never
  bind a checkpoint to its topology."""
  found = set()

  def visit(path, x):
    if isinstance(x, CompressionStats):
      for sub, _ in jax.tree_util.tree_flatten_with_path(x)[0]:
        found.add(_path_str(path) + jax.tree_util.keystr(sub))

  jax.tree_util.tree_map_with_path(
      visit, tree, is_leaf=lambda x: isinstance(x, CompressionStats))
  return found



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
      # An array's (placed) sharding has a concrete Mesh, not an AbstractMesh.
      return cast(Mesh, sharding.mesh)
  return None


def _flat(prefix: str, value) -> dict[str, Any]:
  if isinstance(value, dict):
    out = {}
    for k, v in value.items():
      out.update(_flat(f"{prefix}.{k}" if prefix else str(k), v))
    return out
  return {prefix: value}


def compression_config(tree) -> dict[str, Any]:
  """The configuration of every ``compressed_mean`` in ``tree``, flattened
  to ``{"<path>: compressor.ratio": 0.01, ...}`` (from
  :func:`jaxcomp.transform_configs`)."""
  out = {}
  for path, config in transform_configs(tree).items():
    out.update({f"{path}: {k}": v for k, v in _flat("", config).items()})
  return out


def topology_rules(tree) -> dict[str, str]:
  """How each per-device leaf jaxcomp knows is restored onto another mesh,
  by its path in ``tree``.

  * ``"average"``: every new device gets the mean over the saved devices.
    Error-feedback state (residuals, EF21's estimates, DGC's momentum and
    accumulation), Zen's overflow, the gradient accumulator of
    :func:`jaxcomp.multi_steps` and the statistics: what the mean update will
    still receive from them, ``mean_i(e_i)``, is preserved, not how it was
    split between devices.
  * ``"rechunk"``: the two-phase all-reduce's second-phase residuals, where
    device ``j`` holds the correction of chunk ``j`` of the bucket: the saved
    rows are joined into the bucket's whole correction and cut into the new
    device count's chunks, so the total pending correction is preserved
    exactly.
  * ``"refuse: <why>"``: no sound rule (the hierarchical collective's
    per-group state); a restore onto another mesh is refused naming it.

  Per-device leaves not listed have no rule either.
  """
  rules = {}

  def visit(path, x):
    base = _path_str(path) if path else ""
    if isinstance(x, CompressedMeanState):
      # Each part declares its own rule (Feedback.topology,
      # Collective.topology), carried in the state's configuration.
      declared = x.config.topology
      for sub, _ in jax.tree_util.tree_flatten_with_path(x)[0]:
        rules[base + jax.tree_util.keystr(sub)] = declared.get(
            sub[0].name, "average")
    elif isinstance(x, MultiStepsState):
      for sub, _ in jax.tree_util.tree_flatten_with_path(x.acc_grads)[0]:
        rules[base + ".acc_grads" + jax.tree_util.keystr(sub)] = "average"

  jax.tree_util.tree_map_with_path(
      visit, tree,
      is_leaf=lambda x: isinstance(x, (CompressedMeanState, MultiStepsState)))
  return rules


def describe(tree, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """The metadata saved next to a checkpoint of ``tree``.

  Returns:
    A JSON-serialisable dict: ``format``, ``config`` (every
    ``compressed_mean``'s own configuration, read from the state by
    :func:`compression_config`, plus whatever the caller adds), ``process_count``, ``device_count``, ``mesh``
    (``{axis: size}``), and ``leaves``: per leaf its tree ``path``, ``shape``,
    ``dtype`` and partition ``spec`` (``P()`` for replicated leaves,
    ``P(axes)`` for per-device ones such as error-feedback residuals).
  """
  mesh = _mesh_of(tree)
  stats = _stats_paths(tree)
  leaves = []
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    leaves.append({"path": _path_str(path), "shape": list(np.shape(x)),
                   "dtype": str(np.dtype(x.dtype)), "spec": _spec_str(x),
                   "stats": _path_str(path) in stats})
  return {
      "format": CHECKPOINT_FORMAT,
      "config": json.loads(json.dumps({**compression_config(tree),
                                       **dict(config or {})})),
      "process_count": jax.process_count(),
      "device_count": int(mesh.devices.size) if mesh is not None else
                      jax.device_count(),
      "mesh": {str(k): int(v) for k, v in mesh.shape.items()} if mesh
              is not None else {},
      "leaves": leaves,
  }


def _per_device_leaves(meta, *, include_stats: bool = False) -> list[str]:
  """Paths of the leaves sharded over the mesh (one row per device).

  Per-device statistics (the leaves of a :class:`jaxcomp.CompressionStats`,
  e.g. the residual norm) are left out unless ``include_stats``: every step
  overwrites them, so they never make a checkpoint topology-bound.
  """
  return [l["path"] for l in meta["leaves"] if l["spec"] != "P()" and (
      include_stats or not l["stats"])]


def validate(saved: Mapping[str, Any], current: Mapping[str, Any],
             where: str = "checkpoint") -> None:
  """Raises :class:`CheckpointMismatchError` where ``saved`` metadata does
  not fit ``current`` (both from :func:`describe`), naming what differs."""
  if saved.get("format") != CHECKPOINT_FORMAT:
    raise CheckpointMismatchError(
        f"{where} has metadata format {saved.get('format')!r}, this jaxcomp "
        f"reads formats {READABLE_FORMATS}")
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
        "topology, or pass on_topology_change='redistribute' to move each "
        "per-device leaf by its rule (residuals averaged: the pending update "
        "is preserved, the per-device split is not; two-phase residuals "
        "re-chunked exactly)")
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
    config: anything else that must match on restore, JSON-serialisable
      (e.g. ``{"hidden": 256}``). The compression configuration needs no
      writing: every ``compressed_mean`` in the saved state records its own
      (compressor, hyperparameters, collective, error feedback, bucketing,
      seed; :func:`compression_config`), and a restore into a transform
      configured otherwise is refused, naming the hyperparameter.
    max_to_keep: keep only the newest checkpoints (None: keep all).

  Example::

    ckpt = jaxcomp.checkpoint.Checkpointer("/ckpt")
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
    # Each process records what it wrote (file sizes), last: a step whose
    # records are not all there, or whose files differ, is not complete.
    step_dir = os.path.join(self.directory, str(step))
    me = jax.process_index()
    record = os.path.join(step_dir, _INTEGRITY, f"process_{me}.json")
    os.makedirs(os.path.dirname(record), exist_ok=True)
    with open(record + ".tmp", "w") as f:
      json.dump(_record(step_dir, me), f)
    os.replace(record + ".tmp", record)
    # Named by the peer watcher if a process of the job dies later.
    distributed.note_checkpoint(step, self.directory)

  def damage(self, step: int) -> str | None:
    """What is wrong with ``step``'s files, or None when every process's
    files are there as written (checked against the size and BLAKE2b
    digest of each file that each process recorded when it saved: every
    file is read once)."""
    step_dir = os.path.join(self.directory, str(int(step)))
    try:
      processes = int(self.metadata(step).get("process_count", 1))
    except Exception as e:  # pylint: disable=broad-except
      return f"its metadata cannot be read ({type(e).__name__}: {e})"
    for i in range(processes):
      record = os.path.join(step_dir, _INTEGRITY, f"process_{i}.json")
      if not os.path.exists(record):
        return (f"process {i} did not finish saving it (no record of its "
                "files)")
      try:
        with open(record) as f:
          written = dict(json.load(f))
      except (OSError, ValueError, TypeError) as e:
        return (f"process {i}'s record of its files cannot be read "
                f"({type(e).__name__})")
      now = _listing(step_dir, i)
      for rel, entry in sorted(written.items()):
        # [bytes, digest]; a bare size in records of jaxcomp before digests.
        size, digest = (entry, None) if isinstance(entry, int) else entry
        if rel not in now:
          return f"process {i}'s file {rel} is missing"
        if now[rel] != size:
          return (f"process {i}'s file {rel} has {now[rel]} bytes, "
                  f"{size} were written")
        if digest is not None and _digest_file(
            os.path.join(step_dir, rel)) != digest:
          return (f"process {i}'s file {rel} has other contents than were "
                  "written (its digest differs)")
    return None

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

  def _complete(self, step):
    """``step`` (default: the newest complete one), checked whole before any
    array is read: a damaged default falls back, with a warning, to the
    newest complete step; a damaged named step is refused."""
    if step is not None:
      step = self._resolve(step)
      problem = self.damage(step)
      if problem:
        good = [s for s in sorted(self._manager.all_steps(), reverse=True)
                if s != step and self.damage(s) is None]
        raise CheckpointDamagedError(
            f"checkpoint {self.directory} step {step} is damaged: {problem}"
            + (f"; the newest complete step is {good[0]}" if good else
               "; no complete step is left"))
      return step
    newest = self._resolve(None)
    problems = []
    for s in sorted(self._manager.all_steps(), reverse=True):
      problem = self.damage(s)
      if problem is None:
        if problems:
          warnings.warn(
              f"checkpoint {self.directory}: " + "; ".join(problems)
              + f"; restoring step {s}, the newest complete one",
              RuntimeWarning, stacklevel=3)
        return int(s)
      problems.append(f"step {s} is damaged: {problem}")
    raise CheckpointDamagedError(
        f"no complete checkpoint in {self.directory} (newest {newest}): "
        + "; ".join(problems))

  def restore(self, target, step: int | None = None, *,
              on_topology_change: str = "refuse"):
    """Restores a checkpoint into arrays shaped and sharded like ``target``.

    Args:
      target: a pytree of global ``jax.Array``s (or ``jax.ShapeDtypeStruct``s
        with shardings) with the structure of the saved state, e.g. the
        freshly initialised ``{"params": ..., "opt_state": ...}``; its
        shardings say where each restored leaf goes.
      step: the step to restore; default the newest complete one (a newer
        step whose files are missing or truncated is skipped with a
        ``RuntimeWarning`` that names it and the process whose data is
        damaged).
      on_topology_change: what to do when the checkpoint holds per-device
        state for another number of devices or another mesh shape:
        ``"refuse"`` (default) raises :class:`CheckpointMismatchError`;
        ``"redistribute"`` (``"average"``, its former name, is the same)
        moves every per-device leaf by its rule (:func:`topology_rules`):
        error-feedback residuals averaged (the pending mean update kept, its
        split between devices not, so the run does not continue
        bit-exactly), two-phase residuals re-chunked (the total pending
        correction kept exactly), and a leaf with no sound rule refused by
        name. Replicated leaves are restored exactly in every case.

    Returns:
      ``(step, state)``: bit-exact copies of the saved arrays, placed with
      ``target``'s shardings, in ``target``'s tree structure.

    Raises:
      FileNotFoundError: no checkpoint (at that step).
      CheckpointDamagedError: the named step is damaged, or no complete
        step is left; the message names the step, the process and the file.
      CheckpointMismatchError: another compression config, tree structure,
        leaf shape or dtype, or (with ``"refuse"``) device topology; the
        message names what differs.
      ValueError: an unknown ``on_topology_change``.
    """
    if on_topology_change not in ("refuse", "redistribute", "average"):
      raise ValueError("on_topology_change must be 'refuse' or "
                       f"'redistribute', got {on_topology_change=}")
    step = self._complete(step)
    saved, keys = _upgrade(self.metadata(step))
    current = describe(target, self.config)
    where = f"checkpoint {self.directory} step {step}"
    per_device = set(_per_device_leaves(saved, include_stats=True))
    topology_changed = bool(per_device) and (
        saved.get("device_count") != current["device_count"] or
        saved.get("mesh") != current["mesh"])
    rules = {}
    if topology_changed:
      if on_topology_change != "refuse":
        rules = topology_rules(target)
        for path in sorted(per_device):
          rule = rules.get(path, "refuse: jaxcomp knows no rule for it")
          if rule.startswith("refuse"):
            raise CheckpointMismatchError(
                f"{where} holds per-device state {path} for mesh "
                f"{saved['mesh']}, and it cannot move to mesh "
                f"{current['mesh']} ({rule.split(': ', 1)[1]}); restore "
                "onto the saved topology or start a fresh run")
      # Per-device rows may differ in number (and two-phase chunks in
      # length); everything else must match.
      checked = {**current, "leaves": _with_shapes(
          current["leaves"], saved["leaves"], per_device, rules)}
      if on_topology_change != "refuse":
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
      abstract[keys[i]] = jax.ShapeDtypeStruct(shape, x.dtype,
                                               sharding=sharding)
    # Leaves of an older format that this one no longer has are read and
    # dropped (Orbax restores the tree it saved).
    replicated = NamedSharding(_mesh_of(target) or jax.sharding.Mesh(
        np.asarray(jax.devices()[:1]), ("_",)), P())
    for key, leaf in keys.dropped.items():
      abstract[key] = jax.ShapeDtypeStruct(
          tuple(leaf["shape"]), np.dtype(leaf["dtype"]), sharding=replicated)
    ocp = self._ocp
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))["state"]
    restored = []
    for i, x in enumerate(leaves):
      value = out[keys[i]]
      if topology_changed and paths[i] in per_device:
        move = (_rechunk_rows if rules.get(paths[i]) == "rechunk"
                else _average_rows)  # statistics: rewritten next step
        value = move(value, x)
      restored.append(value)
    distributed.note_checkpoint(step, self.directory)
    return step, jax.tree.unflatten(treedef, restored)

  def close(self) -> None:
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class _Keys(list):
  """The Orbax key of each leaf of an upgraded checkpoint's metadata (its
  index among the leaves as saved), and the leaves an older format had that
  this one drops (``{key: leaf metadata}``)."""

  def __init__(self, keys, dropped):
    super().__init__(keys)
    self.dropped = dropped


def _upgrade(saved: Mapping[str, Any]) -> tuple[dict[str, Any], _Keys]:
  """``saved`` metadata in this version's format, and where each leaf's
  array is stored.

  Format 2 held each ``compressed_mean`` state's configuration digest as a
  ``uint32[2]`` leaf (``<state>.config``); format 3 carries the
  configuration as static data (the metadata's ``config`` section, which
  both formats write, is what restore compares), so that leaf is dropped;
  and the own-exchange collective's name reads as it is today.
  """
  leaves = list(saved.get("leaves", []))
  if saved.get("format") == 2:
    # The collective registered as "compressor" is "own_exchange" now.
    config = {k: ("own_exchange" if k.endswith(": collective.name")
                  and v == "compressor" else v)
              for k, v in saved.get("config", {}).items()}
    saved = {**saved, "config": config}
    keep, dropped = [], {}
    for i, leaf in enumerate(leaves):
      if (leaf["path"].endswith(".config") and leaf["dtype"] == "uint32"
          and leaf["shape"] == [2]):
        dropped[f"{i:05d}"] = leaf
      else:
        keep.append((f"{i:05d}", leaf))
    return ({**saved, "format": CHECKPOINT_FORMAT,
             "leaves": [leaf for _, leaf in keep]},
            _Keys([k for k, _ in keep], dropped))
  return dict(saved), _Keys([f"{i:05d}" for i in range(len(leaves))], {})


def _with_shapes(current_leaves, saved_leaves, per_device, rules):
  """``current_leaves`` with the saved shapes of the per-device leaves (whose
  leading device axis may differ, and a re-chunked leaf's chunk length),
  for validating everything else."""
  out = []
  for c, s in zip(current_leaves, saved_leaves):
    rechunk = rules.get(c["path"]) == "rechunk" and len(c["shape"]) == 2
    if c["path"] in per_device and c["path"] == s["path"] and (
        rechunk or c["shape"][1:] == s["shape"][1:]):
      c = {**c, "shape": s["shape"]}
    out.append(c)
  return out


def _place(full: np.ndarray, like) -> jax.Array:
  return jax.make_array_from_callback(like.shape, like.sharding,
                                      lambda i: np.ascontiguousarray(full[i]))


def _average_rows(value: jax.Array, like) -> jax.Array:
  """Mean over the saved leading device axis, repeated for ``like``'s."""
  host = np.asarray(value.addressable_shards[0].data)
  mean = np.mean(host.astype(np.float64), axis=0).astype(host.dtype)
  return _place(np.broadcast_to(mean, like.shape), like)


def _rechunk_rows(value: jax.Array, like) -> jax.Array:
  """The saved chunks (row ``j`` = chunk ``j``) joined into one buffer and
  cut into ``like``'s rows: the whole correction moves, entry for entry."""
  whole = np.asarray(value.addressable_shards[0].data).reshape(-1)
  size = int(np.prod(like.shape))
  if np.any(whole[size:]):
    raise CheckpointMismatchError(
        f"two-phase residual of {whole.size} entries does not fit "
        f"{like.shape} without losing its nonzero tail")
  full = np.zeros(size, whole.dtype)
  full[:min(size, whole.size)] = whole[:size]
  return _place(full.reshape(like.shape), like)
