"""Restoring per-device state onto another mesh: each leaf's rule
(:func:`topology_rules`) and the moves that apply it (rows averaged, or
two-phase chunks re-cut)."""

from __future__ import annotations

import jax
import numpy as np

from jaxcomp.checkpoint._metadata import CheckpointMismatchError
from jaxcomp.checkpoint._metadata import _path_str
from jaxcomp.checkpoint._metadata import _per_device_leaves
from jaxcomp.checkpoint._metadata import validate
from jaxcomp.combinators import MultiStepsState
from jaxcomp.transform import CompressedMeanState


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


def _check_fit(saved, current, target, where, on_topology_change):
  """Checks that the ``saved`` metadata fits ``current`` (both from
  :func:`describe`; ``target`` is the tree being restored into), allowing,
  unless ``on_topology_change`` is ``"refuse"``, per-device leaves saved for
  another mesh when each has a rule (:func:`topology_rules`).

  Returns:
    ``(per_device, topology_changed, rules)``: the paths of the saved
    per-device leaves (statistics included), whether the devices or mesh
    differ, and each path's rule (empty unless the state moves).

  Raises:
    CheckpointMismatchError: as :func:`validate`, or a per-device leaf with
      no sound rule for the new mesh.
  """
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
  return per_device, topology_changed, rules
