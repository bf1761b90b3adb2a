"""Bucket plans: which gradient leaves are compressed together (see
:mod:`jaxcomp.bucketing`)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, cast
from collections.abc import Iterable, Sequence

import jax

from jaxcomp.bucketing._mgwfbp import mgwfbp_plan

STRATEGIES = ("auto", "layerwise", "whole", "fixed", "fixed_bytes", "mgwfbp")
BUFFER_ITEMSIZE = 4  # buckets are float32 buffers
# bucketing="auto"'s size, bytes of float32: the message size at which a ring
# all-reduce's start-up time equals its transfer time on the performance
# model's default network (`jaxcomp whatif`: p = 16 workers, alpha = 50 us
# per message, 10 Gbit/s): 2 (p - 1) alpha = 2 (p - 1) / p * m * beta gives
# m = p * alpha / beta = 16 * 50e-6 s * 1.25e9 B/s = 1e6 bytes. A leaf below
# it spends more time starting its own exchange than sending its bytes.
# (tests/test_perfmodel.py checks this against the model's formulas.)
DEFAULT_BUCKET_BYTES = 1_000_000


@dataclasses.dataclass(frozen=True)
class BucketPlan:
  """exact: leaf indices averaged exactly; buckets: tuples of leaf indices."""

  exact: tuple[int, ...]
  buckets: tuple[tuple[int, ...], ...]


def _positive_int(value, name: str) -> None:
  if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
      or value < 1):
    raise ValueError(f"{name} must be an integer >= 1, got {name}={value!r}")


def _sequence(value) -> bool:
  """Whether ``value`` can be iterated (a 0-d array says it can, but
  raises)."""
  if not isinstance(value, Iterable):
    return False
  try:
    iter(value)
  except TypeError:
    return False
  return True


def check_config(strategy: str, *, bucket_elements: int | None = None,
                 bucket_bytes: int | None = None,
                 plan: Sequence[Sequence[int]] | None = None) -> None:
  """Validates a bucketing configuration before any leaf is seen.

  Raises:
    ValueError: unknown strategy; ``"fixed"`` without ``bucket_elements``
      >= 1; ``"fixed_bytes"`` without ``bucket_bytes`` >= 1;
      ``bucket_elements`` or ``bucket_bytes`` given to another strategy;
      ``"mgwfbp"`` without a ``plan``; a plan that is not lists of
      non-negative integers.
  """
  if plan is not None:
    if isinstance(plan, (str, bytes)) or not _sequence(plan):
      raise ValueError(f"plan must be lists of leaf indices (jax.tree.leaves "
                       f"order), got plan={plan!r}")
    for bucket in plan:
      if isinstance(bucket, (str, bytes)) or not _sequence(bucket) or not all(
          isinstance(i, numbers.Integral) and not isinstance(i, bool)
          and i >= 0 for i in bucket):
        raise ValueError(
            f"plan must be lists of leaf indices (jax.tree.leaves order), "
            f"got bucket {bucket!r}")
    return
  if not isinstance(strategy, str) or strategy not in STRATEGIES:
    raise ValueError(f"bucketing must be one of {STRATEGIES}, got {strategy!r}")
  # A size the strategy does not read would be silently ignored (e.g.
  # bucket_bytes given, the default layer-wise buckets used).
  for name, value, needs in (("bucket_elements", bucket_elements, ("fixed",)),
                             ("bucket_bytes", bucket_bytes,
                              ("fixed_bytes", "auto"))):
    if value is not None and strategy not in needs:
      raise ValueError(
          f"{name} is read only by bucketing={' or '.join(map(repr, needs))}"
          f", got {name}={value!r} with bucketing={strategy!r}; pass "
          f"bucketing={needs[0]!r} or drop {name}")
  if strategy == "fixed":
    if bucket_elements is None:
      raise ValueError("bucketing='fixed' needs bucket_elements >= 1, got "
                       f"{bucket_elements=}")
    _positive_int(bucket_elements, "bucket_elements")
  if strategy == "fixed_bytes":
    if bucket_bytes is None:
      raise ValueError("bucketing='fixed_bytes' needs bucket_bytes >= 1, got "
                       f"{bucket_bytes=}")
    _positive_int(bucket_bytes, "bucket_bytes")
  if strategy == "auto" and bucket_bytes is not None:
    _positive_int(bucket_bytes, "bucket_bytes")
  if strategy == "mgwfbp":
    raise ValueError(
        "bucketing='mgwfbp' needs plan=jaxcomp.bucketing.mgwfbp_plan_for("
        "params, backward_times, alpha, beta): the merge plan depends on "
        "per-layer backward times and the network's alpha and beta")


def fill(order: Sequence[int], sizes: Sequence[int], limit: float
         ) -> tuple[tuple[int, ...], ...]:
  """Fixed-size buckets: walks ``order`` (indices into ``sizes``), closing a
  bucket as soon as it holds at least ``limit`` (a single larger item is a
  bucket alone); the last one may be smaller. The rule of PyTorch DDP's and
  Horovod's fusion buffers, used by :func:`plan_buckets` (elements) and the
  performance model's fixed-size plans (bytes).

  Example:
    >>> fill([2, 1, 0], [5, 1, 3], 4)
    ((2, 1), (0,))
  """
  buckets, cur, total = [], [], 0
  for i in order:
    cur.append(i)
    total += sizes[i]
    if total >= limit:
      buckets.append(tuple(cur))
      cur, total = [], 0
  if cur:
    buckets.append(tuple(cur))
  return tuple(buckets)


def merge_small(order: Sequence[int], sizes: Sequence[int], limit: float,
                kinds: Sequence | None = None) -> tuple[tuple[int, ...], ...]:
  """``bucketing="auto"``'s buckets: walks ``order`` (indices into
  ``sizes``); an item of at least ``limit`` is a bucket alone, where it
  comes; the smaller ones are packed by kind (``kinds[i]``, e.g. the
  leaves' dtypes; one kind when None), in order, past the large items
  between them, each bucket closed as soon as it holds at least ``limit``
  (the buckets still open at the end come last).

  Example:
    >>> merge_small([0, 1, 2, 3, 4], [1, 1, 9, 2, 2], 4)
    ((2,), (0, 1, 3), (4,))
  """
  buckets: list[tuple[int, ...]] = []
  open_: dict = {}  # kind -> (items, total)
  for i in order:
    if sizes[i] >= limit:
      buckets.append((i,))
      continue
    kind = None if kinds is None else kinds[i]
    items, total = open_.get(kind, ((), 0))
    items, total = items + (i,), total + sizes[i]
    if total >= limit:
      buckets.append(items)
      open_.pop(kind, None)
    else:
      open_[kind] = (items, total)
  buckets.extend(items for items, _ in open_.values())
  return tuple(buckets)


def plan_buckets(sizes: Sequence[int], *, strategy: str = "layerwise",
                 min_size: int = 0, bucket_elements: int | None = None,
                 bucket_bytes: int | None = None,
                 plan: Sequence[Sequence[int]] | None = None,
                 kinds: Sequence | None = None) -> BucketPlan:
  """Plans buckets for leaves of the given element counts.

  Args:
    sizes: number of elements of each leaf, in ``jax.tree.leaves`` order.
    strategy: one of :data:`STRATEGIES` (see the module docstring).
    min_size: leaves with fewer elements go to the exact group (not applied
      to an explicit ``plan``, which names its own exact leaves).
    bucket_elements: bucket size in elements for ``"fixed"``.
    bucket_bytes: bucket size in bytes of the float32 buffer (4 bytes per
      element) for ``"fixed_bytes"``; a bucket is closed as soon as it holds
      at least that many bytes, so a single larger leaf is a bucket alone.
      For ``"auto"``: the size below which a leaf is packed with the other
      small ones (default :data:`DEFAULT_BUCKET_BYTES`).
    kinds: ``"auto"`` only: per leaf, a kind (its dtype) that a merged
      bucket does not mix, so a bucket travels in its leaves' own dtype.
    plan: an explicit plan (lists of leaf indices); overrides ``strategy``.
      Leaves it does not name go to the exact group.

  Returns:
    A :class:`BucketPlan`.

  Raises:
    ValueError: as :func:`check_config`, a size that is not a whole number
      >= 0, or a plan naming a leaf twice or out of range.
  """
  if any(isinstance(s, bool) or not isinstance(s, numbers.Real)
         or not float(s).is_integer() or s < 0 for s in sizes):
    raise ValueError(f"sizes must be whole numbers of elements >= 0, one per "
                     f"leaf, got sizes={list(sizes)!r}")
  sizes = [int(s) for s in sizes]
  check_config(strategy, bucket_elements=bucket_elements,
               bucket_bytes=bucket_bytes, plan=plan)
  if plan is not None:
    seen = set()
    for bucket in plan:
      for i in bucket:
        if not 0 <= i < len(sizes) or i in seen:
          raise ValueError(
              f"plan names leaf {i} twice or out of range (there are "
              f"{len(sizes)} leaves)")
        seen.add(i)
    buckets = tuple(tuple(int(i) for i in b) for b in plan if len(b))
    exact = tuple(i for i in range(len(sizes)) if i not in seen)
    return BucketPlan(exact, buckets)
  exact = tuple(i for i, s in enumerate(sizes) if s < max(min_size, 1))
  big = [i for i, s in enumerate(sizes) if s >= max(min_size, 1)]
  if strategy == "layerwise":
    return BucketPlan(exact, tuple((i,) for i in big))
  if strategy == "whole":
    return BucketPlan(exact, (tuple(big),) if big else ())
  if strategy == "auto":
    limit = DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    return BucketPlan(exact, merge_small(
        big, sizes, -(-limit // BUFFER_ITEMSIZE), kinds))
  # check_config made the size the strategy reads an int >= 1.
  if strategy == "fixed":
    return BucketPlan(exact, fill(big, sizes, cast(int, bucket_elements)))
  return BucketPlan(exact, fill(big, sizes,
                                -(-cast(int, bucket_bytes) // BUFFER_ITEMSIZE)))


def _leaf_values(tree_or_seq, params, what: str) -> list[float]:
  n_leaves = len(jax.tree.leaves(params))
  if jax.tree.structure(tree_or_seq) == jax.tree.structure(params):
    values = jax.tree.leaves(tree_or_seq)
  else:
    values = list(tree_or_seq)
  if len(values) != n_leaves:
    raise ValueError(
        f"{what} must give one value per parameter leaf ({n_leaves}), as a "
        f"pytree like params or a sequence in jax.tree.leaves order; got "
        f"{len(values)}")
  out = []
  for v in values:
    v = float(v)
    if not math.isfinite(v) or v < 0:
      raise ValueError(f"{what} must be finite and >= 0, got {v}")
    out.append(v)
  return out


def mgwfbp_plan_for(params: Any, backward_times: Any, alpha: float,
                    beta: float, *, order: Sequence[int] | None = None,
                    min_size: int = 0,
                    compressor: Any = None) -> list[list[int]]:
  """The MG-WFBP merge plan for ``params``, as ``compressed_mean(plan=...)``.

  Runs :func:`mgwfbp_plan` on the leaves' float32 bytes
  (``4 * size``) or, with ``compressor``, on their compressed payload bytes
  (``comm_time(m) = alpha + beta * compressor.payload_bytes(m / 4)``), and
  maps its layer buckets back to leaf indices.

  Args:
    params: the parameter pytree (arrays or ``jax.ShapeDtypeStruct``).
    backward_times: backward seconds per leaf: a pytree like ``params`` or a
      sequence in ``jax.tree.leaves`` order.
    alpha: start-up seconds of one message (>= 0).
    beta: seconds per byte of one all-reduce (>= 0); for a ring on ``p``
      workers, ``2 (p - 1) / p`` times the link's seconds per byte.
    order: leaf indices in *forward* order (the input layer first, its
      gradient computed last). Default: ``jax.tree.leaves`` order. Pass it
      when leaf names do not sort in forward order (flax sorts by name).
    min_size: leaves with fewer elements are left out of the plan (they go
      through compressed_mean's exact pmean); their backward time is added
      to the layer computed right after them.
    compressor: optional compressor whose ``payload_bytes`` is what travels.

  Returns:
    Buckets in communication order (output layer first), each a list of
    leaf indices consecutive in ``order``.

  Raises:
    ValueError: ``backward_times`` or ``order`` do not match the leaves,
      negative times, alpha or beta; or no leaf is left to plan.

  Example:
    >>> import jax.numpy as jnp
    >>> params = [jnp.zeros(10), jnp.zeros(10), jnp.zeros(10)]
    >>> mgwfbp_plan_for(params, [1e-3] * 3, alpha=1.0, beta=0.0)
    [[0, 1, 2]]

  References:
    Shi, Chu & Li, MG-WFBP: Efficient Data Communication for Distributed
    Synchronous SGD Algorithms <https://arxiv.org/abs/1811.11141>, 2019.
  """
  leaves = jax.tree.leaves(params)
  times = _leaf_values(backward_times, params, "backward_times")
  n = len(leaves)
  order = list(range(n)) if order is None else [int(i) for i in order]
  if sorted(order) != list(range(n)):
    raise ValueError(f"order must be a permutation of the {n} leaf indices, "
                     f"got {order}")
  sizes = [math.prod(getattr(x, "shape", ())) for x in leaves]
  kept, kept_times = [], []
  pending = 0.0  # backward time of skipped leaves after the last kept one
  for pos in reversed(order):  # backward order: output layer first
    if sizes[pos] < max(min_size, 1):
      pending += times[pos]
      continue
    kept.append(pos)
    kept_times.append(times[pos] + pending)
    pending = 0.0
  if not kept:
    raise ValueError(f"no leaf has at least {min_size=} elements to plan")
  kept_times[-1] += pending
  kept.reverse()
  kept_times.reverse()
  layer_bytes = [BUFFER_ITEMSIZE * sizes[i] for i in kept]
  comm_time = None
  if compressor is not None:
    comm_time = lambda m: alpha + beta * compressor.payload_bytes(  # noqa: E731
        max(1, int(round(m / BUFFER_ITEMSIZE))))
  layer_plan = mgwfbp_plan(layer_bytes, kept_times, alpha, beta,
                           comm_time=comm_time)
  return [[kept[j] for j in bucket] for bucket in layer_plan]
