"""Which gradient leaves are compressed together.

A :class:`BucketPlan` splits the flattened gradient leaves (in
``jax.tree.leaves`` order) into an *exact* group, averaged with a plain
``pmean`` (leaves too small to be worth compressing: biases, norms), and
*buckets*, each flattened into one float32 buffer and compressed as a whole.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

STRATEGIES = ("layerwise", "whole", "fixed")


@dataclasses.dataclass(frozen=True)
class BucketPlan:
  """exact: leaf indices averaged exactly; buckets: tuples of leaf indices."""

  exact: tuple[int, ...]
  buckets: tuple[tuple[int, ...], ...]


def plan_buckets(sizes: Sequence[int], *, strategy: str = "layerwise",
                 min_size: int = 0, bucket_elements: int | None = None,
                 plan: Sequence[Sequence[int]] | None = None) -> BucketPlan:
  """Plans buckets for leaves of the given element counts.

  Args:
    sizes: number of elements of each leaf, in ``jax.tree.leaves`` order.
    strategy: ``"layerwise"`` (one bucket per leaf), ``"whole"`` (one bucket
      for all compressed leaves) or ``"fixed"`` (consecutive leaves merged
      until a bucket holds at least ``bucket_elements`` elements).
    min_size: leaves with fewer elements go to the exact group.
    bucket_elements: bucket size for ``"fixed"``.
    plan: an explicit plan (lists of leaf indices); overrides ``strategy``.
      Leaves it does not name go to the exact group.

  Raises:
    ValueError: unknown strategy, a missing or non-positive
      ``bucket_elements`` for ``"fixed"``, or a plan naming a leaf twice or
      out of range.
  """
  sizes = [int(s) for s in sizes]
  if plan is not None:
    seen = set()
    for bucket in plan:
      for i in bucket:
        if not 0 <= i < len(sizes) or i in seen:
          raise ValueError(
              f"plan names leaf {i} twice or out of range (there are "
              f"{len(sizes)} leaves)")
        seen.add(i)
    buckets = tuple(tuple(b) for b in plan if len(b))
    exact = tuple(i for i in range(len(sizes)) if i not in seen)
    return BucketPlan(exact, buckets)
  if strategy not in STRATEGIES:
    raise ValueError(f"bucketing must be one of {STRATEGIES}, got {strategy!r}")
  exact = tuple(i for i, s in enumerate(sizes) if s < max(min_size, 1))
  big = [i for i, s in enumerate(sizes) if s >= max(min_size, 1)]
  if strategy == "layerwise":
    return BucketPlan(exact, tuple((i,) for i in big))
  if strategy == "whole":
    return BucketPlan(exact, (tuple(big),) if big else ())
  if bucket_elements is None or bucket_elements < 1:
    raise ValueError(
        "bucketing='fixed' needs bucket_elements >= 1, got "
        f"{bucket_elements=}")
  buckets, cur, total = [], [], 0
  for i in big:
    cur.append(i)
    total += sizes[i]
    if total >= bucket_elements:
      buckets.append(tuple(cur))
      cur, total = [], 0
  if cur:
    buckets.append(tuple(cur))
  return BucketPlan(exact, tuple(buckets))
