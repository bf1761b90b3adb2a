"""The metadata saved next to a checkpoint (:func:`describe`: the
compression configuration, the topology, every leaf's path, shape, dtype
and spec), its check on restore (:func:`validate`) and the reading of older
formats (``_upgrade``)."""

from __future__ import annotations

import json
from typing import Any, cast
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxcomp import optimizers
from jaxcomp.transform import CompressionStats
from jaxcomp.transform import transform_configs

# 2: leaves carry a "stats" flag (statistics are found by type).
# 3: a compressed_mean state's configuration is static data of the tree
#    (no "config" digest leaf); format 2 checkpoints still restore.
CHECKPOINT_FORMAT = 3
READABLE_FORMATS = (2, 3)


class CheckpointMismatchError(ValueError):
  """A checkpoint does not fit this run (compressor, tree, shapes, devices)."""


def _path_str(path) -> str:
  """A leaf's path as the metadata names it (``"<root>"`` for the root):
  part of the checkpoint format, spelled as
  :func:`jaxcomp.distributed.check_consistency` names leaves."""
  return jax.tree_util.keystr(path) or "<root>"


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
  """The configuration of every ``compressed_mean`` and compressed
  optimizer in ``tree``, flattened to ``{"<path>: compressor.ratio": 0.01,
  ...}`` (from :func:`jaxcomp.transform_configs` and
  :func:`jaxcomp.optimizers.optimizer_configs`)."""
  out = {}
  configs = {**transform_configs(tree), **optimizers.optimizer_configs(tree)}
  for path, config in configs.items():
    out.update({f"{path}: {k}": v for k, v in _flat("", config).items()})
  return out


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
