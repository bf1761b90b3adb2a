"""Deprecated: the names this module held before the step builders became
one family (:mod:`jaxcomp.steps`) and state placement its own module
(:mod:`jaxcomp.placement`). Each still resolves, with a
``DeprecationWarning`` that names its home; import them from ``jaxcomp``
itself (``jaxcomp.init_sharded``, ``jaxcomp.make_train_step``, ...).
"""

import warnings

from jaxcomp import _mesh
from jaxcomp import jit
from jaxcomp import placement
from jaxcomp import steps

_HOMES = {
    "CompressedValueAndGrad": jit, "compressed_value_and_grad": jit,
    "make_train_step": steps, "shard_train_step": steps, "step_loss": steps,
    "init_sharded": placement, "per_device_grad": placement,
    "per_device_value_and_grad": placement,
    "state_partition_specs": placement, "to_global": placement,
    "to_local": placement, "to_varying": _mesh, "varying_axes": _mesh,
}

# jaxcomp re-exports each of these names but step_loss, which only its
# home names (jaxcomp.steps.step_loss).
_NOT_IN_JAXCOMP = frozenset({"step_loss"})

__all__ = [
    "CompressedValueAndGrad", "compressed_value_and_grad", "init_sharded",
    "make_train_step", "per_device_grad", "per_device_value_and_grad",
    "shard_train_step", "state_partition_specs", "step_loss", "to_global",
    "to_local", "to_varying", "varying_axes",
]


def __getattr__(name: str):
  home = _HOMES.get(name)
  if home is None:
    raise AttributeError(f"module 'jaxcomp.sharding' has no attribute {name!r}")
  use = (f"{home.__name__}.{name}" if name in _NOT_IN_JAXCOMP
         else f"jaxcomp.{name}")
  warnings.warn(
      f"jaxcomp.sharding is deprecated: use {use} (defined in "
      f"{home.__name__})", DeprecationWarning, stacklevel=2)
  return getattr(home, name)
