"""The anchor on disk: Orbax checkpoints of each island's committed anchor
(``checkpoint_dir/<island>``), and at start the newest of any island.

Orbax is imported when a checkpoint is first touched (it is only needed
with ``checkpoint_dir``)."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from jaxcomp.elastic._common import ElasticConfigError
from jaxcomp.elastic._common import differences
from jaxcomp.elastic._common import digest


def _manager_for(path: str):
  """Orbax's module and a CheckpointManager of ``path`` (two steps kept,
  synchronous writes)."""
  import orbax.checkpoint as ocp  # optional: only with checkpoint_dir
  return ocp, ocp.CheckpointManager(
      path, options=ocp.CheckpointManagerOptions(
          max_to_keep=2, enable_async_checkpointing=False, create=True))


class AnchorCheckpoints:
  """The Orbax checkpoints under ``root``: this island's to write
  (``root/<island>``), every island's to restore from.

  Each step holds ``state`` (``anchor``, ``outer_state``, ``residual``, as
  host arrays) and ``meta`` (JSON: the configuration's fingerprint and
  description, the step, the island, the anchor's :func:`digest`).
  """

  def __init__(self, root: str, island: str):
    self.root, self.island = root, island
    self._mine = None

  def save(self, step: int, state: dict, fingerprint: str,
           description: dict) -> None:
    """Writes ``state`` (``anchor``, ``outer_state``, ``residual``) at
    ``step`` and waits for the write."""
    if self._mine is None:
      self._mine = _manager_for(os.path.join(self.root, self.island))
    ocp, mgr = self._mine
    # Host values: the same on every process of the island (Orbax writes
    # them once).
    state = jax.tree.map(np.asarray, state)
    mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        meta=ocp.args.JsonSave({"fingerprint": fingerprint,
                                "description": description,
                                "step": step, "island": self.island,
                                "digest": digest(state["anchor"])})))
    mgr.wait_until_finished()

  def _newest(self):
    best = None
    names = sorted(os.listdir(self.root)) if os.path.isdir(self.root) else []
    for name in names:
      path = os.path.join(self.root, name)
      if not os.path.isdir(path):
        continue
      ocp, mgr = _manager_for(path)
      step = mgr.latest_step()
      if step is not None and (best is None or step > best[0]):
        best = (step, name, ocp, mgr)
    return best

  def restore_newest(self, fingerprint: str, description: dict,
                     template: dict) -> tuple[int, str, Any] | None:
    """The newest step of any island under ``root``.

    Args:
      fingerprint: this island's configuration's.
      description: its description (to name what differs).
      template: ``anchor``, ``outer_state`` and ``residual`` as this
        island holds them (structure, shapes and dtypes).

    Returns:
      ``(step, island, state)`` with ``state`` like ``template`` (host
      arrays), or None when there is no checkpoint.

    Raises:
      ElasticConfigError: the newest checkpoint holds another
        configuration.
    """
    best = self._newest()
    if best is None:
      return None
    step, name, ocp, mgr = best
    meta = mgr.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]
    if meta["fingerprint"] != fingerprint:
      raise ElasticConfigError(
          f"the checkpoint {os.path.join(self.root, name)} (step {step}) "
          f"holds another model or configuration ("
          f"{differences(description, meta['description'])}); use "
          "another checkpoint_dir or the same configuration")
    state = mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(jax.tree.map(np.asarray, template))
    ))["state"]
    return int(step), name, state
