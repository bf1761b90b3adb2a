"""The :class:`Checkpointer`: saving and restoring a whole train state
with Orbax."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxcomp import distributed
from jaxcomp.checkpoint._integrity import CheckpointDamagedError
from jaxcomp.checkpoint._integrity import _INTEGRITY
from jaxcomp.checkpoint._integrity import _digest_file
from jaxcomp.checkpoint._integrity import _listing
from jaxcomp.checkpoint._integrity import _record
from jaxcomp.checkpoint._metadata import _mesh_of
from jaxcomp.checkpoint._metadata import _path_str
from jaxcomp.checkpoint._metadata import _upgrade
from jaxcomp.checkpoint._metadata import describe
from jaxcomp.checkpoint._topology import _average_rows
from jaxcomp.checkpoint._topology import _check_fit
from jaxcomp.checkpoint._topology import _rechunk_rows


class Checkpointer:
  """Saves and restores a whole train state with Orbax, in single- and
  multi-process jobs.

  The state is any pytree of global ``jax.Array``s, typically ``{"params":
  params, "opt_state": opt_state, ...}`` with ``opt_state`` from
  :func:`jaxcomp.init`: per-device residuals (sharded ``P(axes)``,
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
    per_device, topology_changed, rules = _check_fit(
        saved, current, target, where, on_topology_change)
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
