"""Which of DeepSpeed's compressed optimizers an optimizer state holds (for
the layouts that refuse them)."""

from __future__ import annotations

import jax

from jaxcomp.optimizers._onebit_adam import OneBitAdamState
from jaxcomp.optimizers._onebit_lamb import OneBitLambState
from jaxcomp.optimizers._zero_one_adam import ZeroOneAdamState

_NAMES = {OneBitAdamState: "onebit_adam", ZeroOneAdamState: "zero_one_adam",
          OneBitLambState: "onebit_lamb"}


def compressed_optimizers_in(opt_state) -> list[str]:
  """The names (``"onebit_adam"``, ``"zero_one_adam"``, ``"onebit_lamb"``)
  of the compressed optimizers whose states ``opt_state`` holds, in tree
  order (empty: none)."""
  found: list[str] = []
  is_state = lambda x: type(x) in _NAMES
  jax.tree_util.tree_map(
      lambda x: found.append(_NAMES[type(x)]) if is_state(x) else None,
      opt_state, is_leaf=is_state)
  return found


def optimizer_configs(opt_state) -> dict[str, dict]:
  """The hyperparameters of every compressed optimizer in ``opt_state``, by
  its path in the state (as :func:`jaxcomp.transform_configs` gives
  ``compressed_mean``'s): ``{path: {"optimizer": name, "freeze_step": ...,
  "b1": ..., "nonfinite": ..., ...}}``; a learning-rate schedule reads
  ``"scheduled"``."""
  found: dict[str, dict] = {}
  is_state = lambda x: type(x) in _NAMES

  def visit(path, x):
    if is_state(x):
      found[jax.tree_util.keystr(path)] = x.config.as_dict()

  jax.tree_util.tree_map_with_path(visit, opt_state, is_leaf=is_state)
  return found
