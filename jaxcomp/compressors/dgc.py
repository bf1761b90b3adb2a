"""Deep Gradient Compression's sparsifier: top-k from a sampled threshold,
and its exponential sparsity warm-up as an Optax schedule."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import optax

from jaxcomp.compressors import _hparams
from jaxcomp.compressors.base import ratio_slots, register
from jaxcomp.compressors.sparse import SparsePayload, largest_eligible
from jaxcomp.kernels import compact

# Candidate slots beyond the capacity: when up to this many more than k pass
# the sampled threshold, the surplus (the smallest of them) is dropped by a
# top-k over the candidates alone; more than that (a sample far off) falls
# back to a top-k over the whole buffer.
def surplus_slots(cap: int) -> int:
  """Candidate slots beyond a capacity of ``cap``: ``max(256, cap / 4)``."""
  return max(256, -(-cap // 4))


@register
@dataclasses.dataclass(frozen=True)
class DGC(SparsePayload):
  """DGC top-k: the threshold is estimated from a random sample.

  For ``k = ceil(ratio * n)``: draw ``m = ceil(sample_ratio * n)`` entries
  (with replacement, independent per device), take the
  ``ceil(m * k / n)``-th largest ``|x|`` of the sample as threshold ``t``.
  Adjust within bounds: while fewer than ``lower_bound * k`` entries pass
  ``t``, halve ``t`` (at most ``max_adjust`` times); if more than ``k`` pass,
  send the ``k`` largest of those (DGC's hierarchical top-k on the selected
  set). So at most ``k`` entries travel; slots left free carry zeros.

  Cost: a top-k of the ``m`` sampled magnitudes gives ``t``; one pass over
  ``x`` packs ``|x| >= t`` into bit masks (one more per halving, rarely
  needed), from which the candidates are compacted in index order
  (:mod:`jaxcomp.kernels.compact`); when more than ``k`` pass, the surplus
  is dropped by a top-k over at most :func:`surplus_slots` candidates.
  Nothing sorts or selects over ``n`` unless the surplus is larger than
  that (a sample far off), when it falls back to a top-k over the buffer.
  Biased: error feedback is on by default; DGC's momentum correction and
  factor masking are the ``"dgc"`` feedback
  (:class:`jaxcomp.feedback.DGCFeedback`, use
  ``error_feedback="dgc"`` and plain SGD after the transform) and its sparsity
  warm-up is :func:`dgc_warmup_schedule`.

  ``ratio`` may be scheduled (``optax.inject_hyperparams``) with
  ``max_ratio`` as the static capacity: the payload holds
  ``k_max = ceil(max_ratio * n)`` pairs, entries beyond the traced ``k`` are
  zeros. A buffer smaller than ``k`` sends all of its entries.

  Payload: ``values`` ``(k,)`` in the gradient's dtype and ``indices``
  int32 ``(k,)``: ``8 * k`` bytes for float32 (``k_max`` with
  ``max_ratio``), all-gathered.

  Args:
    ratio: fraction of entries sent (1 - sparsity), in (0, 1].
    sample_ratio: fraction of entries sampled for the threshold, in (0, 1].
    lower_bound: fraction of k below which the threshold is lowered, [0, 1].
    max_adjust: most halvings of the threshold, >= 0.
    max_ratio: static capacity when ``ratio`` is scheduled, or None.

  Raises:
    ValueError: a ratio outside (0, 1], ``ratio > max_ratio``, a traced
      ``ratio`` without ``max_ratio``, ``lower_bound`` outside [0, 1],
      ``max_adjust`` < 0.

  References:
    Lin et al., Deep Gradient Compression: Reducing the Communication
    Bandwidth for Distributed Training <https://arxiv.org/abs/1712.01887>,
    2018.
  """

  name: ClassVar[str] = "dgc"
  biased: ClassVar[bool] = True
  vmappable: ClassVar[bool] = False  # its lax.cond on the data
  randomness: ClassVar[str] = "independent"
  ratio: float = 0.001
  sample_ratio: float = 0.01
  lower_bound: float = 0.8
  max_adjust: int = 4
  max_ratio: float | None = None

  def __post_init__(self):
    _hparams.check_ratio_capacity(self.ratio, self.max_ratio)
    if self.sample_ratio is not None:
      _hparams.check_number(self.sample_ratio, "sample_ratio", low=0.0,
                            high=1.0, low_open=True)
    _hparams.check_number(self.lower_bound, "lower_bound", low=0.0, high=1.0)
    _hparams.check_number(self.max_adjust, "max_adjust", low=0, integer=True)

  def capacity(self, n: int) -> int:
    return ratio_slots(self.ratio, self.max_ratio, n)

  def k(self, n: int) -> jax.Array:
    """int32 scalar: the number of entries selected (<= capacity)."""
    return _hparams.ceil_count(self.ratio, n, self.capacity(n))

  def _sampled_threshold(self, x: jax.Array, key: jax.Array):
    """``(t, words)``: the sampled, adjusted threshold for ``|x|`` and the
    packed mask ``|x| >= t`` (one pass over ``x``, plus one per halving)."""
    n = x.shape[0]
    cap = self.capacity(n)
    k = self.k(n)
    m = max(1, min(n, math.ceil(self.sample_ratio * n)))
    mag = lambda v: jnp.abs(v).astype(jnp.float32)
    ks = max(1, math.ceil(m * cap / n))  # static rank at capacity ...
    # The ks largest of the sample, descending (a top-k, not a sort of m).
    # The barrier keeps XLA:CPU from rewriting "one element of a top-k"
    # into a slower sort (3.5 ms instead of 0.07 ms for 18,637 samples).
    sample = lax.optimization_barrier(
        lax.top_k(mag(x[jax.random.randint(key, (m,), 0, n)]), ks)[0])
    # ... and the traced rank for k <= capacity.
    rank = jnp.clip(jnp.ceil(jnp.float32(m) * k.astype(jnp.float32)
                             / jnp.float32(n)).astype(jnp.int32), 1, ks)
    need = jnp.float32(self.lower_bound) * k.astype(jnp.float32)
    above = lambda t: compact.pack(x, lambda v: mag(v) >= t)

    def too_few(c):
      _, words, i = c
      return (compact.count(words).astype(jnp.float32) < need) & (
          i < self.max_adjust)

    def halve(c):
      t, _, i = c
      return t * 0.5, above(t * 0.5), i + 1

    t = sample[rank - 1]
    first = (t, above(t), jnp.int32(0))
    # The halving loop sits in a branch that runs only when it must: XLA
    # hoists the loop-invariant |x| out of the loop, and outside a branch
    # that would write |x| to memory on every step (two passes over x).
    t, words, _ = lax.cond(too_few(first),
                           lambda c: lax.while_loop(too_few, halve, c),
                           lambda c: c, first)
    return t, words

  def threshold(self, x: jax.Array, key: jax.Array) -> jax.Array:
    """float32 scalar: the sampled, adjusted threshold for ``|x|``."""
    return self._sampled_threshold(x, key)[0]

  def encode(self, x, key):
    """The sampled threshold's candidates are compacted in index order (no
    sort over ``n``). When more than ``k`` pass, the surplus, at most
    :func:`surplus_slots` of them, is dropped by a top-k over the
    candidates alone; a larger surplus falls back to a top-k over ``x``."""
    # x is read by several passes (sample, mask, gathers): have XLA compute
    # it once rather than fuse a bucket's concatenation into each of them.
    x = lax.optimization_barrier(x)
    n = x.shape[0]
    cap = self.capacity(n)
    k = self.k(n)
    t, words = self._sampled_threshold(x, key)
    total = compact.count(words)
    cand = min(n, cap + surplus_slots(cap))
    surplus_cap = cand - cap
    idx, valid = compact.compact(words, cand)

    def all_candidates():  # total <= k <= cap: every candidate is sent
      return jnp.where(valid[:cap], x[idx[:cap]], 0), idx[:cap]

    def drop_surplus():  # k < total <= k + surplus_cap: drop the smallest
      score = jnp.where(valid, jnp.abs(x[idx]).astype(jnp.float32), jnp.inf)
      _, smallest = lax.top_k(-score, surplus_cap)  # ascending |x|
      drop = jnp.zeros((cand,), jnp.bool_).at[smallest].set(
          jnp.arange(surplus_cap) < total - k)
      kept = compact.pack(valid & ~drop, lambda v: v)
      slots, live = compact.compact(kept, cap)
      return jnp.where(live, x[idx[slots]], 0), jnp.where(live, idx[slots], 0)

    def fall_back():  # the sample was far off: a top-k over all of x
      values, i = largest_eligible(x, jnp.abs(x).astype(jnp.float32) >= t,
                                   cap)
      return jnp.where(jnp.arange(cap) < k, values, 0), i

    branch = jnp.where(total <= k, 0, jnp.where(
        total - k <= surplus_cap, 1, 2))
    values, idx = lax.switch(branch, (all_candidates, drop_surplus,
                                      fall_back))
    return {"values": values, "indices": idx}


def dgc_warmup_schedule(final_ratio: float = 0.001, stage_steps: int = 1,
                        decay: float = 0.25):
  """DGC's exponential sparsity warm-up as an Optax schedule of ``ratio``.

  ``ratio(step) = max(final_ratio, decay ** (step // stage_steps + 1))``:
  with the default ``decay = 0.25`` the sparsity goes 75%, 93.75%, 98.4375%,
  99.6%, 99.9% (the paper's warm-up over its first epochs when
  ``stage_steps`` is one epoch of steps). The target is reached at step
  :func:`dgc_warmup_steps` ``(final_ratio, stage_steps, decay)``. Use it with
  ``optax.inject_hyperparams`` and ``max_ratio=decay`` (the first stage's
  ratio, the capacity).

  Args:
    final_ratio: the ratio after warm-up, in (0, 1].
    stage_steps: steps per stage (> 0).
    decay: ratio multiplier per stage, in (0, 1).

  Returns:
    A schedule ``step -> float32 ratio``.

  Raises:
    ValueError: an argument outside its range.

  References:
    Lin et al., Deep Gradient Compression <https://arxiv.org/abs/1712.01887>,
    2018, Section 3.3 (warm-up training).
  """
  _hparams.check_number(final_ratio, "final_ratio", low=0.0, high=1.0,
                        low_open=True)
  _hparams.check_number(stage_steps, "stage_steps", low=1, integer=True)
  if not 0.0 < decay < 1.0:
    raise ValueError(f"decay must be in (0, 1), got {decay=}")

  def schedule(step):
    stage = jnp.asarray(step, jnp.int32) // stage_steps
    r = jnp.power(jnp.float32(decay), (stage + 1).astype(jnp.float32))
    return jnp.maximum(jnp.float32(final_ratio), r)

  return schedule


def dgc_warmup_stages(final_ratio: float = 0.001, stage_steps: int = 1,
                      decay: float = 0.25) -> list[tuple[int, float]]:
  """:func:`dgc_warmup_schedule`'s distinct values as static stages.

  ``[(first_step, ratio), ...]``: ``(0, decay)``, ``(stage_steps,
  decay ** 2)``, ... and last ``(dgc_warmup_steps(...), final_ratio)``.
  A scheduled ``ratio`` keeps a payload of the first stage's capacity all
  along (XLA's shapes are static), so it sends ``decay`` of the entries
  every step; building one compiled step per stage instead (with the
  stage's ``ratio`` as a plain float, the optimizer state carried across,
  see ``examples/char_lm``) lets each stage send only its own ratio.

  Raises:
    ValueError: an argument outside its range (as the schedule).
  """
  dgc_warmup_schedule(final_ratio, stage_steps, decay)  # checks the arguments
  last = dgc_warmup_steps(final_ratio, stage_steps, decay)
  return [(s, max(final_ratio, decay ** (s // stage_steps + 1)))
          for s in range(0, last + 1, stage_steps)]


def dgc_warmup_steps(final_ratio: float = 0.001, stage_steps: int = 1,
                     decay: float = 0.25) -> int:
  """First step at which :func:`dgc_warmup_schedule` equals ``final_ratio``:
  ``stage_steps * (ceil(log(final_ratio) / log(decay)) - 1)``."""
  stages = math.ceil(math.log(final_ratio) / math.log(decay) - 1e-9)
  return stage_steps * max(stages - 1, 0)


# -- DGC's sparsity warm-up as static stages --------------------------------
#
# One transformation (and one compiled step) per ratio, each sending its own
# payload: the stages of dgc_warmup_stages, each built by the user's make_tx.


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
