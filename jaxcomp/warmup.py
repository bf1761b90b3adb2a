"""DGC's sparsity warm-up as static stages: one transformation (and one
compiled step) per ratio, each sending its own payload."""

from __future__ import annotations

from typing import NamedTuple

import optax

from jaxcomp.compressors.dgc import dgc_warmup_stages


class WarmupStage(NamedTuple):
  """One stage of :func:`sparsity_warmup`."""

  first_step: int  # the stage starts at this step (0 for the first)
  ratio: float  # the fraction sent in this stage
  tx: optax.GradientTransformation  # the stage's transformation


def sparsity_warmup(make_tx, final_ratio: float, stage_steps: int,
                    decay: float = 0.25) -> list[WarmupStage]:
  """DGC's exponential sparsity warm-up as static stages that really send
  fewer bytes stage by stage.

  A scheduled ``ratio`` (``optax.inject_hyperparams``) keeps the payload of
  its largest value all along (XLA's shapes are static). Here each stage of
  :func:`jaxcomp.compressors.dgc_warmup_stages` (ratio ``decay``,
  ``decay ** 2``, ... down to ``final_ratio``, ``stage_steps`` steps each)
  gets its own transformation ``make_tx(ratio)``, compiled into its own
  step, so each sends its own payload. One optimizer state is carried from
  stage to stage: the stages' states must have the same structure (true of
  the sparsifiers with residual or DGC error feedback);
  ``compressed_mean`` refuses a state that does not fit, naming the leaf.

  Args:
    make_tx: ``ratio -> GradientTransformation`` (e.g. a chain of
      ``compressed_mean("topk", "data", ratio=ratio)`` and an optimizer).
    final_ratio: the ratio after the warm-up, in (0, 1].
    stage_steps: steps per stage, >= 1.
    decay: ratio multiplier per stage, in (0, 1).

  Returns:
    The stages, first step first.

  Raises:
    ValueError: an argument outside its range.

  Example:
    >>> import jaxcomp
    >>> stages = jaxcomp.sparsity_warmup(
    ...     lambda r: jaxcomp.compressed_mean("topk", "data", ratio=r),
    ...     final_ratio=0.01, stage_steps=100)
    >>> [(s.first_step, s.ratio) for s in stages]
    [(0, 0.25), (100, 0.0625), (200, 0.015625), (300, 0.01)]

  References:
    Lin et al., Deep Gradient Compression <https://arxiv.org/abs/1712.01887>,
    2018, Section 3.3 (warm-up training).
  """
  return [WarmupStage(first, ratio, make_tx(ratio))
          for first, ratio in dgc_warmup_stages(final_ratio, stage_steps,
                                                decay)]


def stage_at(stages, step: int) -> int:
  """Index of the stage of :func:`sparsity_warmup` that ``step`` is in."""
  return max(i for i, s in enumerate(stages) if s.first_step <= step)


def bytes_over(stages, stage_bytes, steps_run: int) -> float:
  """Bytes one device sent over the first ``steps_run`` steps, each stage of
  :func:`sparsity_warmup` at its bytes per step ``stage_bytes[i]`` (e.g.
  ``get_stats(state).bytes_sent`` of its transformation)."""
  ends = [s.first_step for s in stages[1:]] + [steps_run]
  return sum(max(0, min(end, steps_run) - s.first_step) * b
             for s, end, b in zip(stages, ends, stage_bytes))
