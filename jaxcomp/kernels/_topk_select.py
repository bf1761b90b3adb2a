"""The sampled-threshold top-k selection that every top-k path shares.

:mod:`jaxcomp.kernels.topk` describes the wire format and how the selection
works. Here: the knobs (:class:`TopKConfig`), the key ordering ``|x|``
(:func:`abs_key`), the bit-mask selection over ``n / 32`` words
(:func:`exact_words`, on :mod:`jaxcomp.kernels.compact`), the sample's plan
and thresholds (:func:`sample_plan`, :func:`sample_top_keys`), the exact
top-k among compacted candidates (:func:`among_candidates`), the selection
itself given a mask pass (:func:`sampled_select`, taken by the XLA and the
Pallas path), DGC's sampled threshold (:func:`dgc_threshold`), and the XLA
path :func:`topk_threshold_xla`, which the Triton path
(:mod:`jaxcomp.kernels._topk_triton`) falls back to. Re-exported by
:mod:`jaxcomp.kernels.topk`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from . import _launch
from . import compact


@dataclasses.dataclass(frozen=True)
class TopKConfig:
  """Tuning knobs of the top-k kernels and of the XLA fast path.

  Attributes:
    block_rows: rows of 32 float32 values per grid step (multiple of 64).
    radix_bits: key bits resolved per counting pass (1..5): 5 -> 7 passes.
    sample_size: elements sampled by the XLA fast path for its threshold;
      None: :data:`SAMPLE_SIZE` of the default backend (on one CPU core
      sorting 65,536 keys took 2.5 ms, 16,384 keys 0.58 ms, for candidate
      sets 14% larger: ``python benchmarks/topk_breakdown.py``).
    sample_margin: relative over-selection of the sampled threshold.
    capacity_factor: candidate capacity over the expected candidate count.
    selection: how the sampled selection finds its thresholds and compacts
      (:func:`selection`): ``"sort"`` (the sample's int32 keys sorted in
      full, XLA's cumulative reductions) or ``"partial"`` (the sample's
      largest keys by ``lax.top_k``, log-depth scans); the same indices
      either way. None: :data:`SELECTION` of the default backend.
  """
  block_rows: int = 256
  radix_bits: int = 5
  sample_size: int | None = None
  sample_margin: float = 0.1
  capacity_factor: float = 1.25
  selection: str | None = None


DEFAULT_CONFIG = TopKConfig()

# The fast path's default sample per backend (65,536 elsewhere). On one CPU
# core the whole top-k of 1.86M float32 at 1% took 5.7 ms with 65,536
# samples (the sample's sort 2.5 ms of it) and 3.1 to 4.4 ms with 16,384,
# when the sample was sorted; its top-k (now) takes 0.19 ms at 16,384 and
# 0.58 at 65,536, and the whole selection 2.5 and 3.3 ms in one run
# (python benchmarks/topk_breakdown.py [--sample-size 65536]).
SAMPLE_SIZE = {"cpu": 16384}


def sample_size(config: TopKConfig) -> int:
  """The fast path's sample size under ``config`` on the default backend."""
  if config.sample_size is not None:
    return config.sample_size
  return SAMPLE_SIZE.get(jax.default_backend(), 65536)


# The sampled selection's form per backend ("sort" elsewhere). On this
# project's 2-core CPU the partial sort of 16,384 sample keys took 0.06 ms
# against 0.43 ms for their full int32 sort, and the log-depth prefix sum
# over 58,000 mask words 0.21 ms against 0.55 ms for XLA:CPU's cumsum
# (benchmarks/topk_breakdown.py). On GPUs the full sort and XLA's own
# cumulative reductions are what the path ran when it was measured on an
# H100 (benchmarks/results/kernels_h100_f32.json: 0.34 ms at 1e6 elements,
# 0.59 ms at 2.5e7); the "partial" form there is unmeasured beside it
# (benchmarks/results/NOTES.md says what to time).
SELECTION = {"cpu": "partial"}
SELECTIONS = ("sort", "partial")


def selection(config: TopKConfig) -> str:
  """The sampled selection's form under ``config`` on the default backend:
  ``"sort"`` or ``"partial"``.

  Raises:
    ValueError: ``config.selection`` is neither (nor None).
  """
  form = config.selection or SELECTION.get(jax.default_backend(), "sort")
  if form not in SELECTIONS:
    raise ValueError(f"selection must be one of {SELECTIONS} or None, got "
                     f"{config.selection!r}")
  return form


def check_k(n: int, k: int) -> None:
  if not 0 <= k <= n:
    raise ValueError(f"{k=} must be in [0, {n=}]")


def abs_key(x: jax.Array) -> jax.Array:
  """int32 key ordering ``|x|``: the bit pattern of ``|x|`` as float32."""
  xf = x.astype(jnp.float32)
  return jax.lax.bitcast_convert_type(xf, jnp.int32) & jnp.int32(0x7FFFFFFF)


def abs_f32(x: jax.Array) -> jax.Array:
  """``|x|`` in float32 for ``lax.top_k``: exact and order-preserving for
  16-bit inputs, and XLA's top-k of float32 is the fast one (its bfloat16
  top-k was 12x slower on an H100, its int32 top-k 30x slower on CPU)."""
  return jnp.abs(x.astype(jnp.float32))


def largest_abs(flat: jax.Array, k: int) -> jax.Array:
  """The ``k`` largest ``|flat|``, descending, float32 ``(k,)``: XLA:CPU's
  top-k (a partial sort). The barrier keeps XLA from rewriting "some
  elements of a top-k" into a sort of all of ``flat`` with a slower float
  comparator (16,384 samples: 0.06 ms against 11 ms, and 0.43 ms for a
  sort of their int32 keys, on this project's 2-core CPU)."""
  return jax.lax.optimization_barrier(jax.lax.top_k(abs_f32(flat), k)[0])


def _kth_largest_key(flat: jax.Array, k: int) -> jax.Array:
  """int32 key (see :func:`abs_key`) of the ``k``-th largest ``|flat|``."""
  return abs_key(largest_abs(flat, k)[k - 1])


def sample_top_keys(sample: jax.Array, rank: int, form: str) -> jax.Array:
  """int32 keys (:func:`abs_key`) of the ``rank`` largest ``|sample|``,
  descending: by XLA's top-k of ``|sample|`` in float32 (``"partial"``),
  or the last ``rank`` of the sample's keys sorted in full (``"sort"``).
  The same keys either way (``|x|`` and its key order alike)."""
  if form == "partial":
    return abs_key(largest_abs(sample, rank))
  keys = jnp.sort(abs_key(sample))
  return keys[keys.shape[0] - rank:][::-1]


def empty(x):
  return jnp.zeros((0,), x.dtype), jnp.zeros((0,), jnp.int32)


# ----------------------------------------------------------------------------
# Bit-mask selection (XLA, on n / 32 words): :mod:`jaxcomp.kernels.compact`.
# ----------------------------------------------------------------------------


def keep_lowest(w: jax.Array, a: jax.Array) -> jax.Array:
  """Keeps the lowest ``a`` set bits of each word (``0 <= a <= popcount``)."""
  p = compact.select_bit(w, jnp.maximum(a - 1, 0)).astype(jnp.uint32)
  below = jnp.where(p >= 31, jnp.uint32(0xFFFFFFFF),
                    (jnp.uint32(2) << jnp.minimum(p, 30)) - jnp.uint32(1))
  return jnp.where(a > 0, w & below, jnp.uint32(0))


def exact_words(gt_words, eq_words, k: int, log_depth: bool | None = None):
  """Words with exactly ``k`` bits: all of ``gt``, the lowest ties of ``eq``
  (``log_depth``: the prefix sum's form, :func:`compact.cumsum`)."""
  need = k - compact.count(gt_words)
  pc_eq = compact.popcount(eq_words)
  eq_before = compact.cumsum(pc_eq, log_depth=log_depth) - pc_eq
  a = jnp.clip(need - eq_before, 0, pc_eq)
  return gt_words | keep_lowest(eq_words, a)


def words_xla(flat: jax.Array, pred) -> jax.Array:
  """Packs ``pred(abs_key(flat))`` 32 per uint32 word (:func:`compact.pack`)."""
  return compact.pack(flat, lambda v: pred(abs_key(v)))


def gather(flat, idx, valid=None):
  vals = flat[idx]
  if valid is not None:
    vals = jnp.where(valid, vals, jnp.zeros((), flat.dtype))
  return vals


# ----------------------------------------------------------------------------
# Fast XLA path.
# ----------------------------------------------------------------------------


def sample_plan(n: int, k: int, config: TopKConfig):
  """Static sample size, sample ranks and capacities.

  ``rank`` (``rank_hi``) is the sample rank whose key lets through a few more
  (fewer) than ``k`` elements with high probability; ``cap`` holds the
  candidates above the first, ``band_cap`` those between the two.
  """
  s = min(n, sample_size(config))
  expect = s * k / n
  spread = config.sample_margin * expect + 4 * math.sqrt(expect) + 4
  rank = math.ceil(expect + spread)
  rank_hi = math.floor(expect - spread)
  cap = min(n, math.ceil(rank * n / s * config.capacity_factor) + 256)
  band_cap = math.ceil((rank - max(rank_hi, 0)) * n / s
                       * config.capacity_factor) + 256
  return s, rank, rank_hi, cap, band_cap


@functools.partial(jax.jit, static_argnames=("k", "config"))
def topk_threshold_xla(x: jax.Array, k: int, *,
                       config: TopKConfig = DEFAULT_CONFIG
                       ) -> tuple[jax.Array, jax.Array]:
  """Exact top-k set of ``|x|`` in pure ``jnp``, without sorting ``x``.

  Same set as :func:`jaxcomp.kernels.topk.topk_reference`, in ascending
  index order.

  Args:
    x: float array (any shape; flattened), ``n`` elements.
    k: ``0 <= k <= n``.
    config: sample size and capacity knobs.

  Returns:
    ``(values[k] in x.dtype, indices[k] int32)``, ascending index.
  """
  flat = x.reshape(-1)
  n = flat.shape[0]
  check_k(n, k)
  if k == 0:
    return empty(flat)

  log_depth = selection(config) == "partial"

  def exact_from_top_k():
    t = _kth_largest_key(flat, k)
    words = exact_words(words_xla(flat, lambda kk: kk > t),
                         words_xla(flat, lambda kk: kk == t), k, log_depth)
    idx, _ = compact.compact(words, k, log_depth=log_depth)
    return idx

  def masks(t):  # (>= t now, > t only where the ties branch asks)
    return (words_xla(flat, lambda kk: kk >= t),
            lambda: words_xla(flat, lambda kk: kk > t))

  idx = sampled_select(flat, k, config, masks, exact_from_top_k)
  return gather(flat, idx), idx


def among_candidates(cidx: jax.Array, valid: jax.Array, ckey: jax.Array,
                      top: jax.Array, k: int, config: TopKConfig, *, n: int,
                      log_depth: bool, band_only: bool = True) -> jax.Array:
  """int32 ``(k,)`` positions in ``x`` of the exact top-k, ascending, from
  the candidates ``cidx`` (ascending indices; ``valid`` marks the filled
  slots, ``ckey`` their keys, -1 elsewhere) that hold every element with
  ``key >= top[rank - 1]`` (at least ``k``); ``top``: the sample's largest
  keys, descending. ``band_only``: sort only the keys below the sample's upper
  threshold (fewer keys sorted, a few more kernels) instead of all."""
  _, rank, rank_hi, cap, band_cap = sample_plan(n, k, config)

  def sort_all():
    return jnp.sort(ckey)[cap - k]

  if band_only and 1 <= rank_hi < rank and band_cap < cap:
    # Keys above the upper sample threshold are in for sure; only the band
    # below it needs sorting.
    t_hi = top[rank_hi - 1]
    c_above = jnp.sum(ckey > t_hi)
    band = valid & (ckey <= t_hi)
    band_count = jnp.sum(band)

    def sort_band():
      bpos, live = compact.compact(compact.pack(band, lambda v: v),
                                   band_cap, log_depth=log_depth)
      bkey = jnp.where(live, ckey[bpos], -1)
      return jnp.sort(bkey)[band_cap - (k - c_above)]

    t = jax.lax.cond((c_above < k) & (band_count <= band_cap), sort_band,
                     sort_all)
  else:
    t = sort_all()
  # Exactly k candidates: all above t, the lowest-index ties at t (on
  # packed words: prefix sums over cap / 32 words, not over cap slots).
  words = exact_words(compact.pack(ckey, lambda v: v > t),
                       compact.pack(ckey, lambda v: v == t), k, log_depth)
  pos, _ = compact.compact(words, k, log_depth=log_depth)
  return cidx[pos]


def sampled_select(flat: jax.Array, k: int, config: TopKConfig, masks,
                    exact_from_top_k) -> jax.Array:
  """The sampled-threshold selection shared by the XLA and Pallas paths:
  int32 ``(k,)`` indices of the exact top-k of ``|flat|``, ascending.

  ``masks(t)`` returns the packed words of ``key >= t`` (one pass over
  ``flat``) and a function giving those of ``key > t`` (asked only when
  the candidates overflow); ``exact_from_top_k()`` is the exact fallback
  for when the sample misled (a branch most steps skip).
  """
  n = flat.shape[0]
  s, rank, rank_hi, cap, band_cap = sample_plan(n, k, config)
  form = selection(config)
  log_depth = form == "partial"
  # Inside shard_map every branch must return indices typed as x is (a
  # branch computing from a kernel's or a constant's output may not be).
  typed = lambda idx: idx + _launch.zero_like(flat, jnp.int32)
  exact = lambda: typed(exact_from_top_k())
  if rank >= s or cap >= n:  # Dense selection: sampling does not pay.
    return exact()

  stride = n // s
  # The sample's rank largest keys, descending.
  top = sample_top_keys(flat[: s * stride : stride], rank, form)
  t_lo = top[rank - 1]
  # One pass over x: the candidates' mask. Whether the k-th largest key is
  # t_lo itself (ties) is only asked when the candidates overflow.
  ge, gt_of = masks(t_lo)
  c_ge = compact.count(ge)

  def from_candidates():
    cidx, valid = compact.compact(ge, cap, log_depth=log_depth)
    ckey = jnp.where(valid, abs_key(flat[cidx]), -1)
    return typed(among_candidates(cidx, valid, ckey, top, k, config,
                                   n=n, log_depth=log_depth))

  def ties_or_exact():  # c_ge > cap (or < k): the sample misled
    gt = gt_of()

    def at_t_lo():  # k-th largest key is t_lo itself.
      idx, _ = compact.compact(exact_words(gt, ge & ~gt, k, log_depth), k,
                               log_depth=log_depth)
      return typed(idx)

    return jax.lax.cond((compact.count(gt) < k) & (c_ge >= k), at_t_lo,
                        exact)

  return jax.lax.cond((c_ge >= k) & (c_ge <= cap), from_candidates,
                      ties_or_exact)


# ----------------------------------------------------------------------------
# DGC's sampled threshold (the XLA and the Triton path share it).
# ----------------------------------------------------------------------------


def check_sample_ratio(sample_ratio: float) -> None:
  if not 0 < sample_ratio <= 1:
    raise ValueError(f"sample_ratio must be in (0, 1], got {sample_ratio=}")


def dgc_threshold(flat: jax.Array, k: int, key: jax.Array,
                   sample_ratio: float) -> jax.Array:
  """DGC's int32 key threshold: the ``ceil(m * k / n)``-th largest key of
  ``m = max(1, round(n * sample_ratio))`` elements of ``flat`` drawn
  uniformly with replacement by ``key``."""
  n = flat.shape[0]
  m = max(1, min(n, round(n * sample_ratio)))
  pick = jax.random.randint(key, (m,), 0, n)
  return _kth_largest_key(flat[pick], max(1, math.ceil(m * k / n)))
