"""A transform's configuration, carried in its own state.

Every :func:`jaxcomp.compressed_mean` state holds a :class:`TransformConfig`
as *static* pytree data: no array, nothing to save or restore, part of the
state's tree structure. Whoever holds the state (a checkpoint, the
multi-process agreement check, :func:`transform_configs`, FSDP's checks)
reads the configuration from it, in any process, including one that
restored the state from a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any
from collections.abc import Mapping

import jax
import jax.core
import numpy as np

# How a per-device state field moves to a mesh of another size (see
# jaxcomp.checkpoint.topology_rules): "average", "rechunk", or
# "refuse: <why>".
TopologyRule = str


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class TransformConfig:
  """The configuration of one transform, as static pytree data.

  It annotates the state and takes no part in the identity of its tree
  structure: any two compare equal (and hash alike), so that states of two
  transforms whose arrays are alike are interchangeable, as a warm-up's
  stages pass one state from transform to transform, and a step compiled
  for one takes the other. Each transform's ``update`` writes its own
  configuration into the state it returns. Compare configurations with
  :meth:`as_dict`.

  Attributes:
    text: the configuration as JSON with sorted keys (compressor and its
      hyperparameters, collective, error feedback, bucketing, nonfinite
      policy, seed, axis names, output); a scheduled hyperparameter reads
      ``"scheduled"``.
    rules: ``((state field, rule), ...)``: how each per-device field of the
      state moves to a mesh of another size, as the part that keeps it
      declares (``Feedback.topology``, ``Collective.topology``).
    plan: the bucket plan ``init`` made, where the bucketing depends on
      where ``init`` ran (``"auto"``), else None.
  """

  text: str
  rules: tuple[tuple[str, TopologyRule], ...] = ()
  # The bucket plan ``init`` made (``bucketing="auto"``, whose plan depends
  # on the leaves' types where ``init`` ran: a tensor-parallel shard is kept
  # apart), so that every ``update`` of the state cuts the gradient alike,
  # wherever it is traced; not part of the configuration's description.
  plan: Any = None

  @classmethod
  def of(cls, config: Mapping[str, Any],
         rules: Mapping[str, TopologyRule] | None = None) -> TransformConfig:
    """From a description (values made JSON-able by :func:`describe`)."""
    described = {k: describe(v) for k, v in config.items()}
    return cls(json.dumps(described, sort_keys=True),
               tuple(sorted((rules or {}).items())))

  def __eq__(self, other) -> bool:
    return isinstance(other, TransformConfig)

  def __hash__(self) -> int:
    return hash(TransformConfig)

  def as_dict(self) -> dict[str, Any]:
    """The configuration as a dict."""
    return json.loads(self.text)

  @property
  def topology(self) -> dict[str, TopologyRule]:
    """``{state field: rule}`` of the per-device state fields."""
    return dict(self.rules)


def describe(value):
  """A JSON-able description of a configuration value: dataclasses (the
  compressor, collective, feedback) by their name and init fields, a
  scheduled (traced) hyperparameter as ``"scheduled"``."""
  if isinstance(value, jax.core.Tracer):
    return "scheduled"
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {"name": getattr(value, "name", type(value).__name__),
            **{f.name: describe(getattr(value, f.name))
               for f in dataclasses.fields(value) if f.init}}
  if isinstance(value, (list, tuple)):
    return [describe(v) for v in value]
  if isinstance(value, (str, int, float, bool)) or value is None:
    return value
  if isinstance(value, (jax.Array, np.ndarray)) and np.ndim(value) == 0:
    return np.asarray(value).item()
  return repr(value)


def find_configs(state, state_type) -> dict[str, TransformConfig]:
  """``{path: TransformConfig}`` of every ``state_type`` (a NamedTuple with
  a ``config`` field) in ``state``, by its path (``jax.tree_util.keystr``)."""
  found = {}

  def visit(path, x):
    if isinstance(x, state_type):
      found[jax.tree_util.keystr(path)] = x.config

  jax.tree_util.tree_map_with_path(
      visit, state, is_leaf=lambda x: isinstance(x, state_type))
  return found
