"""Deprecated: DGC's sparsity warm-up lives with DGC,
:mod:`jaxcomp.compressors.dgc` (``jaxcomp.compressors.sparsity_warmup``,
``WarmupStage``, ``stage_at``, ``bytes_over``; ``jaxcomp.sparsity_warmup``
is unchanged). Each name here still resolves, with a ``DeprecationWarning``.
"""

import warnings

from jaxcomp.compressors import dgc

_MOVED = ("WarmupStage", "sparsity_warmup", "stage_at", "bytes_over")

__all__ = ["WarmupStage", "sparsity_warmup", "stage_at", "bytes_over"]


def __getattr__(name: str):
  if name not in _MOVED:
    raise AttributeError(f"module 'jaxcomp.warmup' has no attribute {name!r}")
  warnings.warn(f"jaxcomp.warmup.{name} moved to jaxcomp.compressors.{name} "
                "(jaxcomp.compressors.dgc)", DeprecationWarning, stacklevel=2)
  return getattr(dgc, name)
