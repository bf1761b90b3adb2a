"""Top-k by magnitude without a full sort: threshold selection + compaction.

Wire format (what the top-k compressors send): exactly ``k`` values (in
``x.dtype``) and ``k`` int32 indices into the flattened ``x``. The selected set
is the ``k`` largest ``|x|``; ties at the threshold go to the lowest indices
(what ``lax.top_k`` on ``|x|`` does). Functions here differ only in the order
of the ``k`` pairs:

* :func:`topk_reference` (``lax.top_k``): descending ``|x|``, then ascending
  index. This is the ground truth.
* :func:`topk_threshold_xla` (fast XLA path) and :func:`topk` (Pallas path):
  the same set, in ascending index order.
* :func:`sampled_topk` (DGC, Lin et al, Deep Gradient Compression
  <https://arxiv.org/abs/1712.01887>, 2018): threshold from a random sample,
  so the set is approximate: the elements with ``|x| >= t`` in ascending index
  order, cut to the first ``k``; when fewer than ``k`` pass, the tail is padded
  with index 0 and value 0.0 (a decoder that scatter-adds is unaffected).

NaN inputs are not supported (their ordering is unspecified).

How it works. ``|x|`` is compared through its float32 bit pattern
``key = bitcast(|x|, int32)``, which orders non-negative floats (and ranks
NaN above infinity above every finite value, on every path: a non-finite
entry is always selected, so it shows in what is sent). Given the
exact ``k``-th largest key ``T``, one pass packs two bit masks, 32 elements per
uint32 word: ``key > T`` and ``key == T``. Everything after that touches only
``n / 32`` words and ``k`` outputs: popcounts, a prefix sum over words, which
tie bits to keep (lowest indices first) so that exactly ``k`` bits are set,
the word of each output slot (each non-empty word's number scattered at its
first slot, then a running maximum), a select-the-r-th-set-bit inside the
word, and a gather of the ``k`` values.

Finding ``T`` (both paths share :func:`_sampled_select`): the threshold of
an evenly spaced sample gives a lower bound ``t`` that lets a little more
than ``k`` elements through; the one pass over ``x`` packs ``key >= t``,
those candidates are compacted (same bit-mask machinery) into a fixed
capacity, and ``T`` is their ``k``-th largest key. A second, higher sample
threshold marks the candidates that are in for sure, so only the band
between the two thresholds is sorted (about ``0.4 k`` keys at 1% density).
The sample's thresholds and the compaction's prefix sums come in two forms
of the same values (``TopKConfig.selection``, by default per backend,
:data:`SELECTION`): ``"partial"`` on CPU, the sample's largest keys by
XLA's top-k (a partial sort) and log-depth scans, which XLA:CPU runs
faster; ``"sort"`` elsewhere, the sample's int32 keys sorted in full and
XLA's own cumulative reductions, as when this path was measured on an H100
(0.34 ms at 1e6 elements, 0.59 ms at 2.5e7, 1% kept; it has changed in
other ways since).
If ``T`` is the lower threshold itself (ties, e.g. mostly-zero gradients)
the ``key > t`` mask gives the result; if the sample misled (fewer than
``k`` or more than the capacity pass) a branch finds ``T`` exactly over all
of ``x``. The result is exact on every branch.

* XLA (any backend): the mask pass is a fused XLA loop
  (:func:`compact.pack`), the ``key > t`` mask a second pass taken only in
  the ties branch, and the exact branch ``lax.top_k``.
* Pallas (GPU): the mask pass is one kernel that writes ``key > t`` and
  ``key == t`` together (so ``x`` is read once on every call, and the ties
  branch needs nothing more); the exact branch is a radix select over the
  31-bit key, ``radix_bits`` bits per pass, each pass one kernel that
  counts, per block, the elements with ``key >= base + c * 2**shift`` for
  all digits ``c`` (7 passes of 5 bits), then one more mask kernel. The
  compaction runs in XLA on ``n / 32`` words and the candidates (Mosaic GPU
  stores go through shared memory and TMA copies of whole tiles, which do
  not fit a data-dependent scatter). ``tests/test_kernel_structure.py``
  checks from the CUDA export that outside the exact branch one kernel
  reads ``x`` and XLA reads only the sample.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _autotune
from . import _launch
from . import _triton_select
from . import compact

ROW = _launch.ROW
_NUM_CANDIDATES = 32  # one SMEM/TMA transfer of 128 bytes holds 32 int32.
# The 32 int32 thresholds: the same block (all of them) at every grid step,
# copied to shared memory, where the kernels read them as scalars.
_THRESHOLDS_SPEC = pl.BlockSpec((_NUM_CANDIDATES,), lambda i: (0,))


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


def _check_k(n: int, k: int) -> None:
  if not 0 <= k <= n:
    raise ValueError(f"{k=} must be in [0, {n=}]")


def abs_key(x: jax.Array) -> jax.Array:
  """int32 key ordering ``|x|``: the bit pattern of ``|x|`` as float32."""
  xf = x.astype(jnp.float32)
  return jax.lax.bitcast_convert_type(xf, jnp.int32) & jnp.int32(0x7FFFFFFF)


def _abs_f32(x: jax.Array) -> jax.Array:
  """``|x|`` in float32 for ``lax.top_k``: exact and order-preserving for
  16-bit inputs, and XLA's top-k of float32 is the fast one (its bfloat16
  top-k was 12x slower on an H100, its int32 top-k 30x slower on CPU)."""
  return jnp.abs(x.astype(jnp.float32))


def _largest_abs(flat: jax.Array, k: int) -> jax.Array:
  """The ``k`` largest ``|flat|``, descending, float32 ``(k,)``: XLA:CPU's
  top-k (a partial sort). The barrier keeps XLA from rewriting "some
  elements of a top-k" into a sort of all of ``flat`` with a slower float
  comparator (16,384 samples: 0.06 ms against 11 ms, and 0.43 ms for a
  sort of their int32 keys, on this project's 2-core CPU)."""
  return jax.lax.optimization_barrier(jax.lax.top_k(_abs_f32(flat), k)[0])


def _kth_largest_key(flat: jax.Array, k: int) -> jax.Array:
  """int32 key (see :func:`abs_key`) of the ``k``-th largest ``|flat|``."""
  return abs_key(_largest_abs(flat, k)[k - 1])


def _sample_top_keys(sample: jax.Array, rank: int, form: str) -> jax.Array:
  """int32 keys (:func:`abs_key`) of the ``rank`` largest ``|sample|``,
  descending: by XLA's top-k of ``|sample|`` in float32 (``"partial"``),
  or the last ``rank`` of the sample's keys sorted in full (``"sort"``).
  The same keys either way (``|x|`` and its key order alike)."""
  if form == "partial":
    return abs_key(_largest_abs(sample, rank))
  keys = jnp.sort(abs_key(sample))
  return keys[keys.shape[0] - rank:][::-1]


def _empty(x):
  return jnp.zeros((0,), x.dtype), jnp.zeros((0,), jnp.int32)


# ----------------------------------------------------------------------------
# Reference.
# ----------------------------------------------------------------------------


def topk_reference(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Exact top-k of ``|x|`` by ``lax.top_k``.

  Args:
    x: float array (any shape; flattened), ``n`` elements.
    k: number of elements to keep, ``0 <= k <= n``.

  Returns:
    ``(values[k] in x.dtype, indices[k] int32)``, descending ``|x|``, ties by
    ascending index; on every backend NaN ranks above +-Inf, above every
    finite value (two NaNs, or an Inf and a finite ``|x|`` of exactly the
    largest float32, tie: the lower index first).
  """
  flat = x.reshape(-1)
  _check_k(flat.shape[0], k)
  if k == 0:
    return _empty(flat)
  a = _abs_f32(flat)
  # XLA:GPU's own top-k kernel (k <= 16, n >= 1024) compares with a raw
  # ``>``, so a NaN may never be taken (openxla/xla#48119; the likely cause
  # of the compiled NaN test's failure on an H200 with JAX 0.11.2). The keys
  # hold no NaN: NaN goes in as +Inf and Inf as the largest finite float32,
  # an order every backend's top-k keeps (no cond: this runs under vmap).
  key = jnp.where(jnp.isnan(a), jnp.inf,
                  jnp.where(jnp.isinf(a), jnp.finfo(jnp.float32).max, a))
  _, idx = jax.lax.top_k(key, k)
  idx = idx.astype(jnp.int32)
  return flat[idx], idx


# ----------------------------------------------------------------------------
# Bit-mask selection (XLA, on n / 32 words): :mod:`jaxcomp.kernels.compact`.
# ----------------------------------------------------------------------------


def _keep_lowest(w: jax.Array, a: jax.Array) -> jax.Array:
  """Keeps the lowest ``a`` set bits of each word (``0 <= a <= popcount``)."""
  p = compact.select_bit(w, jnp.maximum(a - 1, 0)).astype(jnp.uint32)
  below = jnp.where(p >= 31, jnp.uint32(0xFFFFFFFF),
                    (jnp.uint32(2) << jnp.minimum(p, 30)) - jnp.uint32(1))
  return jnp.where(a > 0, w & below, jnp.uint32(0))


def _exact_words(gt_words, eq_words, k: int, log_depth: bool | None = None):
  """Words with exactly ``k`` bits: all of ``gt``, the lowest ties of ``eq``
  (``log_depth``: the prefix sum's form, :func:`compact.cumsum`)."""
  need = k - compact.count(gt_words)
  pc_eq = compact.popcount(eq_words)
  eq_before = compact.cumsum(pc_eq, log_depth=log_depth) - pc_eq
  a = jnp.clip(need - eq_before, 0, pc_eq)
  return gt_words | _keep_lowest(eq_words, a)


def _words_xla(flat: jax.Array, pred) -> jax.Array:
  """Packs ``pred(abs_key(flat))`` 32 per uint32 word (:func:`compact.pack`)."""
  return compact.pack(flat, lambda v: pred(abs_key(v)))


def _gather(flat, idx, valid=None):
  vals = flat[idx]
  if valid is not None:
    vals = jnp.where(valid, vals, jnp.zeros((), flat.dtype))
  return vals


# ----------------------------------------------------------------------------
# Fast XLA path.
# ----------------------------------------------------------------------------


def _sample_plan(n: int, k: int, config: TopKConfig):
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

  Same set as :func:`topk_reference`, in ascending index order.

  Args:
    x: float array (any shape; flattened), ``n`` elements.
    k: ``0 <= k <= n``.
    config: sample size and capacity knobs.

  Returns:
    ``(values[k] in x.dtype, indices[k] int32)``, ascending index.
  """
  flat = x.reshape(-1)
  n = flat.shape[0]
  _check_k(n, k)
  if k == 0:
    return _empty(flat)

  log_depth = selection(config) == "partial"

  def exact_from_top_k():
    t = _kth_largest_key(flat, k)
    words = _exact_words(_words_xla(flat, lambda kk: kk > t),
                         _words_xla(flat, lambda kk: kk == t), k, log_depth)
    idx, _ = compact.compact(words, k, log_depth=log_depth)
    return idx

  def masks(t):  # (>= t now, > t only where the ties branch asks)
    return (_words_xla(flat, lambda kk: kk >= t),
            lambda: _words_xla(flat, lambda kk: kk > t))

  idx = _sampled_select(flat, k, config, masks, exact_from_top_k)
  return _gather(flat, idx), idx


def _among_candidates(cidx: jax.Array, valid: jax.Array, ckey: jax.Array,
                      top: jax.Array, k: int, config: TopKConfig, *, n: int,
                      log_depth: bool, band_only: bool = True) -> jax.Array:
  """int32 ``(k,)`` positions in ``x`` of the exact top-k, ascending, from
  the candidates ``cidx`` (ascending indices; ``valid`` marks the filled
  slots, ``ckey`` their keys, -1 elsewhere) that hold every element with
  ``key >= top[rank - 1]`` (at least ``k``); ``top``: the sample's largest
  keys, descending. ``band_only``: sort only the keys below the sample's upper
  threshold (fewer keys sorted, a few more kernels) instead of all."""
  _, rank, rank_hi, cap, band_cap = _sample_plan(n, k, config)

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
  words = _exact_words(compact.pack(ckey, lambda v: v > t),
                       compact.pack(ckey, lambda v: v == t), k, log_depth)
  pos, _ = compact.compact(words, k, log_depth=log_depth)
  return cidx[pos]


def _sampled_select(flat: jax.Array, k: int, config: TopKConfig, masks,
                    exact_from_top_k) -> jax.Array:
  """The sampled-threshold selection shared by the XLA and Pallas paths:
  int32 ``(k,)`` indices of the exact top-k of ``|flat|``, ascending.

  ``masks(t)`` returns the packed words of ``key >= t`` (one pass over
  ``flat``) and a function giving those of ``key > t`` (asked only when
  the candidates overflow); ``exact_from_top_k()`` is the exact fallback
  for when the sample misled (a branch most steps skip).
  """
  n = flat.shape[0]
  s, rank, rank_hi, cap, band_cap = _sample_plan(n, k, config)
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
  top = _sample_top_keys(flat[: s * stride : stride], rank, form)
  t_lo = top[rank - 1]
  # One pass over x: the candidates' mask. Whether the k-th largest key is
  # t_lo itself (ties) is only asked when the candidates overflow.
  ge, gt_of = masks(t_lo)
  c_ge = compact.count(ge)

  def from_candidates():
    cidx, valid = compact.compact(ge, cap, log_depth=log_depth)
    ckey = jnp.where(valid, abs_key(flat[cidx]), -1)
    return typed(_among_candidates(cidx, valid, ckey, top, k, config,
                                   n=n, log_depth=log_depth))

  def ties_or_exact():  # c_ge > cap (or < k): the sample misled
    gt = gt_of()

    def at_t_lo():  # k-th largest key is t_lo itself.
      idx, _ = compact.compact(_exact_words(gt, ge & ~gt, k, log_depth), k,
                               log_depth=log_depth)
      return typed(idx)

    return jax.lax.cond((compact.count(gt) < k) & (c_ge >= k), at_t_lo,
                        exact)

  return jax.lax.cond((c_ge >= k) & (c_ge <= cap), from_candidates,
                      ties_or_exact)




# ----------------------------------------------------------------------------
# Pallas (Mosaic GPU) kernels.
# ----------------------------------------------------------------------------


def _count_kernel(thresholds_ref, x_ref, counts_ref, *, block: _launch.Block):
  """``counts_ref[c] = #(key >= thresholds_ref[c])`` over one block of rows.

  ``thresholds_ref``: int32 (32,) thresholds (shared memory on GPU);
  ``x_ref``: (R, 32) float32; ``counts_ref``: int32 (32,), this block's
  counts.
  """
  x = block.tile(x_ref[...])
  key = jax.lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(0x7FFFFFFF)
  for c in range(_NUM_CANDIDATES):
    per_row = jnp.sum((key >= thresholds_ref[c]).astype(jnp.int32), axis=1)
    counts_ref[c] = jnp.sum(per_row)


def _mask_kernel(thresholds_ref, x_ref, gt_ref, eq_ref, *, block_rows: int,
                 block: _launch.Block):
  """Packs ``key > t`` and ``key == t`` (``t = thresholds_ref[0]``) 32 per
  uint32 word: ``gt_ref``, ``eq_ref`` uint32 ``(R,)``, one word per row."""
  x = block.tile(x_ref[...])
  key = jax.lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(0x7FFFFFFF)
  t = thresholds_ref[0]
  col = block.column_iota(block_rows)
  gt_ref[...] = jnp.sum((key > t).astype(jnp.uint32) << col, axis=1,
                        dtype=jnp.uint32)
  eq_ref[...] = jnp.sum((key == t).astype(jnp.uint32) << col, axis=1,
                        dtype=jnp.uint32)


def count_ge(rows: jax.Array, thresholds: jax.Array, *, block_rows: int,
             interpret: bool | _launch.Interpret = False) -> jax.Array:
  """Counts of ``key >= thresholds[c]`` over ``rows`` (Pallas), int32 (32,)."""
  grid = -(-rows.shape[0] // block_rows)
  counts, = _launch.blocked_call(
      _count_kernel,
      grid=grid,
      inputs=[("thresholds_ref", _THRESHOLDS_SPEC),
              ("x_ref", _launch.rows_spec(block_rows))],
      outputs=[("counts_ref",
                _launch.out_struct((grid * _NUM_CANDIDATES,), jnp.int32, rows),
                pl.BlockSpec((_NUM_CANDIDATES,), lambda i: (i,)))],
      interpret=interpret,
      name="jaxcomp_topk_count",
  )(thresholds, rows)
  return jnp.sum(counts.reshape(grid, _NUM_CANDIDATES), axis=0)


def threshold_masks(rows: jax.Array, t: jax.Array, *, block_rows: int,
                    interpret: bool | _launch.Interpret = False
                    ) -> tuple[jax.Array, jax.Array]:
  """Packed masks ``key > t`` and ``key == t`` (Pallas), uint32 per row."""
  grid = -(-rows.shape[0] // block_rows)
  tvec = jnp.broadcast_to(t.astype(jnp.int32), (_NUM_CANDIDATES,))
  word = _launch.out_struct((rows.shape[0],), jnp.uint32, rows)
  return _launch.blocked_call(
      functools.partial(_mask_kernel, block_rows=block_rows),
      grid=grid,
      inputs=[("thresholds_ref", _THRESHOLDS_SPEC),
              ("x_ref", _launch.rows_spec(block_rows))],
      outputs=[("gt_ref", word, _launch.vector_spec(block_rows)),
               ("eq_ref", word, _launch.vector_spec(block_rows))],
      interpret=interpret,
      name="jaxcomp_topk_mask",
  )(tvec, rows)


def radix_passes(radix_bits: int) -> list[tuple[int, int]]:
  """``(shift, bits)`` of each counting pass over the 31-bit key."""
  if not 1 <= radix_bits <= 5:
    raise ValueError(f"{radix_bits=} must be in [1, 5] (32 counters a pass)")
  passes, hi = [], 31
  while hi > 0:
    b = min(radix_bits, hi)
    passes.append((hi - b, b))
    hi -= b
  return passes


def radix_select(rows: jax.Array, k: int, *, block_rows: int, radix_bits: int,
                 interpret: bool | _launch.Interpret = False) -> jax.Array:
  """Exact ``k``-th largest key of ``rows`` (int32 scalar), by counting."""
  passes = radix_passes(radix_bits)
  shifts = jnp.array([p[0] for p in passes], jnp.int32)
  widths = jnp.array([p[1] for p in passes], jnp.int32)
  digits = jnp.arange(_NUM_CANDIDATES, dtype=jnp.int32)

  def one_pass(i, base):
    # A loop, not a Python unroll: the kernel is lowered and compiled once.
    shift = shifts[i]
    live = digits < (jnp.int32(1) << widths[i])
    # Digit 0 is ``base`` itself (count >= k by induction); unused slots get
    # the largest key, and are masked out below.
    t = jnp.where(live, base + (digits << shift), jnp.int32(0x7FFFFFFF))
    counts = count_ge(rows, t, block_rows=block_rows, interpret=interpret)
    digit = jnp.sum(((counts >= k) & live)[1:]).astype(jnp.int32)
    return base + (digit << shift)

  return jax.lax.fori_loop(0, len(passes), one_pass,
                           _launch.zero_like(rows, jnp.int32))


def _live_words(words: jax.Array, n: int) -> jax.Array:
  """Mask words of padded rows cut to ``ceil(n / 32)``, the bits past ``n``
  cleared (padding reads as key 0, which a threshold of 0 would pass)."""
  m = -(-n // ROW)
  words = words[:m]
  if n % ROW:
    last = jnp.uint32((1 << (n % ROW)) - 1)
    words = words.at[m - 1].set(words[m - 1] & last)
  return words


@functools.partial(jax.jit, static_argnames=("k", "config", "interpret"))
def topk(x: jax.Array, k: int, *, config: TopKConfig = DEFAULT_CONFIG,
         interpret: bool | _launch.Interpret = False
         ) -> tuple[jax.Array, jax.Array]:
  """Exact top-k of ``|x|`` with one Pallas pass over ``x``.

  The XLA fast path's selection (:func:`topk_threshold_xla`: a threshold
  bracket from an evenly spaced sample, the candidates compacted in index
  order, the bracket resolved exactly among them) with its one pass over
  ``x`` done by the Pallas mask kernel, which writes the packed masks
  ``key > t`` and ``key == t`` together (so the ties branch needs no second
  pass). When the sample misleads (the candidates overflow their capacity)
  a branch takes the radix select (7 counting passes) and one more mask
  pass; dense selections (``k`` near ``n``) take it directly. Same set as
  :func:`topk_reference`, in ascending index order.

  Raises:
    ValueError: bad ``k`` or knobs.
  """
  _launch.check_block_rows(config.block_rows)
  flat = x.reshape(-1)
  n = flat.shape[0]
  _check_k(n, k)
  if k == 0:
    return _empty(flat)
  rows, _ = _launch.to_rows(flat, config.block_rows)
  log_depth = selection(config) == "partial"

  def exact_from_top_k():
    t = radix_select(rows, k, block_rows=config.block_rows,
                     radix_bits=config.radix_bits, interpret=interpret)
    gt, eq = threshold_masks(rows, t, block_rows=config.block_rows,
                             interpret=interpret)
    idx, _ = compact.compact(_exact_words(_live_words(gt, n),
                                          _live_words(eq, n), k, log_depth),
                             k, log_depth=log_depth)
    return idx

  def masks(t):
    gt, eq = threshold_masks(rows, t, block_rows=config.block_rows,
                             interpret=interpret)
    gt = _live_words(gt, n)
    return gt | _live_words(eq, n), lambda: gt

  idx = _sampled_select(flat, k, config, masks, exact_from_top_k)
  return _gather(flat, idx), idx


# ----------------------------------------------------------------------------
# Triton-lowered selection.
# ----------------------------------------------------------------------------


TRITON_SPAN = _triton_select.DEFAULT_SPAN


@functools.partial(jax.jit, static_argnames=("k", "config", "span",
                                             "num_warps", "band_only",
                                             "interpret"))
def topk_triton(x: jax.Array, k: int, *, config: TopKConfig = DEFAULT_CONFIG,
                span: int = TRITON_SPAN,
                num_warps: int = _triton_select.DEFAULT_WARPS,
                band_only: bool = False,
                interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Exact top-k of ``|x|`` whose selection is two Triton-lowered kernels.

  The XLA fast path's selection (:func:`topk_threshold_xla`: the lower
  threshold ``t`` of an evenly spaced sample, the candidates ``key >= t``
  compacted in index order into a fixed capacity, the ``k``-th largest key
  found among them) with the compaction done by
  :func:`jaxcomp.kernels._triton_select.select_at_least`: a count pass and
  a compact pass over ``x``, which also returns the candidates' keys, in
  place of the packed masks, prefix sums, scatter and running maximum over
  ``n / 32`` words. The candidates' keys are sorted whole (one sort), or
  with ``band_only`` only those between the sample's two thresholds (the
  XLA path's way: fewer keys sorted, a few more kernels). When the sample
  misleads (fewer than ``k`` or more than the capacity pass, e.g. ties at
  ``t`` in a mostly-zero gradient) a branch runs
  :func:`topk_threshold_xla`. Same set as :func:`topk_reference`, in
  ascending index order.

  Written for NVIDIA GPUs and checked there only by its CUDA export (two
  Triton calls reading ``x``): not yet timed on one, so no ``implementation``
  picks it; ``python -m jaxcomp.bench kernels --ops topk`` times it (rows
  ``pallas:triton``).

  Args:
    x: float array (any shape; flattened), ``n`` elements; float32,
      bfloat16 or float16.
    k: ``0 <= k <= n``.
    config: the sample's knobs (:class:`TopKConfig`).
    span: elements per Triton program (a power of two in [32, 8192]).
    num_warps: warps per Triton program.
    band_only: sort only the band between the sample's thresholds.
    interpret: run the kernels in Pallas' interpret mode (any backend).

  Returns:
    ``(values[k] in x.dtype, indices[k] int32)``, ascending index.

  Raises:
    ValueError: bad ``k``, ``span`` or ``num_warps``.
  """
  _triton_select.check_launch(span, num_warps)
  flat = x.reshape(-1)
  n = flat.shape[0]
  _check_k(n, k)
  if k == 0:
    return _empty(flat)
  s, rank, _, cap, _ = _sample_plan(n, k, config)
  if rank >= s or cap >= n:  # Dense selection: sampling does not pay.
    return topk_threshold_xla(flat, k, config=config)
  form = selection(config)
  stride = n // s
  top = _sample_top_keys(flat[: s * stride : stride], rank, form)
  cidx, ckey, count = _triton_select.select_at_least(
      flat, top[rank - 1], capacity=cap, span=span, num_warps=num_warps,
      interpret=interpret)
  typed = lambda idx: idx + _launch.zero_like(flat, jnp.int32)

  def from_candidates():
    return typed(_among_candidates(
        cidx, jnp.arange(cap) < count, ckey, top, k, config, n=n,
        log_depth=form == "partial", band_only=band_only))

  def misled():
    return typed(topk_threshold_xla(flat, k, config=config)[1])

  idx = jax.lax.cond((count >= k) & (count <= cap), from_candidates, misled)
  return _gather(flat, idx), idx


# ----------------------------------------------------------------------------
# DGC sampled top-k.
# ----------------------------------------------------------------------------


def _check_sample_ratio(sample_ratio: float) -> None:
  if not 0 < sample_ratio <= 1:
    raise ValueError(f"sample_ratio must be in (0, 1], got {sample_ratio=}")


def _dgc_threshold(flat: jax.Array, k: int, key: jax.Array,
                   sample_ratio: float) -> jax.Array:
  """DGC's int32 key threshold: the ``ceil(m * k / n)``-th largest key of
  ``m = max(1, round(n * sample_ratio))`` elements of ``flat`` drawn
  uniformly with replacement by ``key``."""
  n = flat.shape[0]
  m = max(1, min(n, round(n * sample_ratio)))
  pick = jax.random.randint(key, (m,), 0, n)
  return _kth_largest_key(flat[pick], max(1, math.ceil(m * k / n)))


def sampled_topk(x: jax.Array, k: int, key: jax.Array, *, sample_ratio: float,
                 config: TopKConfig = DEFAULT_CONFIG,
                 implementation: str | None = None,
                 interpret: bool | _launch.Interpret = False
                 ) -> tuple[jax.Array, jax.Array]:
  """DGC top-k: threshold from a random sample, compaction into ``k`` slots.

  The threshold ``t`` is the ``ceil(m * k / n)``-th largest ``|x|`` of
  ``m = max(1, round(n * sample_ratio))`` elements drawn uniformly (with
  replacement) with ``key``. Elements with ``|x| >= t`` are taken in ascending
  index order, at most ``k``; missing slots hold index 0 and value 0.0. The
  mask pass runs on the Pallas kernel or in XLA (``implementation``, or
  with None as :func:`jaxcomp.kernels.resolve_implementation` picks).

  Returns:
    ``(values[k] in x.dtype, indices[k] int32)``.

  Raises:
    ValueError: ``sample_ratio`` not in (0, 1] or bad ``k``.
  """
  _check_sample_ratio(sample_ratio)
  _check_k(x.size, k)

  def run(impl, interpret):
    return lambda v, key_: _sampled_topk(
        v, k, key_, sample_ratio=sample_ratio, config=config,
        implementation=impl, interpret=interpret)

  tunable = _autotune.Tunable(
      op="sampled_topk", n=x.size, dtype=x.dtype, run=run,
      extras=lambda v: (jax.random.key(2),),
      params={"density": _density_class(x.size, k),
              "sample_ratio": sample_ratio,
              "in_place": _rows_in_place(x.size, x.dtype),
              **_config_params(config)},
      supported=k > 0)
  implementation = _autotune.resolve_implementation(implementation,
                                                    tunable=tunable)
  return _sampled_topk(x, k, key, sample_ratio=sample_ratio, config=config,
                       implementation=implementation, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("k", "sample_ratio", "config",
                                             "implementation", "interpret"))
def _sampled_topk(x, k, key, *, sample_ratio, config, implementation,
                  interpret):
  flat = x.reshape(-1)
  if k == 0:
    return _empty(flat)
  t = _dgc_threshold(flat, k, key, sample_ratio)
  if implementation == "pallas":
    _launch.check_block_rows(config.block_rows)
    rows, _ = _launch.to_rows(flat, config.block_rows)
    gt, eq = threshold_masks(rows, t, block_rows=config.block_rows,
                             interpret=interpret)
    words = gt | eq
  else:
    words = _words_xla(flat, lambda kk: kk >= t)
  idx, valid = compact.compact(words, k,
                               log_depth=selection(config) == "partial")
  return _gather(flat, idx, valid), idx


@functools.partial(jax.jit, static_argnames=("k", "sample_ratio", "span",
                                             "num_warps", "interpret"))
def sampled_topk_triton(x: jax.Array, k: int, key: jax.Array, *,
                        sample_ratio: float, span: int = TRITON_SPAN,
                        num_warps: int = _triton_select.DEFAULT_WARPS,
                        interpret: bool = False
                        ) -> tuple[jax.Array, jax.Array]:
  """:func:`sampled_topk` (DGC) with its selection done by the two
  Triton-lowered kernels of :func:`topk_triton`
  (:func:`jaxcomp.kernels._triton_select.select_at_least` with capacity
  ``k``): the same threshold from the same sample, the same values and
  indices.

  Not yet timed on a GPU, so no ``implementation`` picks it (``python -m
  jaxcomp.bench kernels --ops sampled_topk``, row ``pallas:triton``).

  Returns:
    ``(values[k] in x.dtype, indices[k] int32)``.

  Raises:
    ValueError: ``sample_ratio`` not in (0, 1], bad ``k``, ``span`` or
      ``num_warps``.
  """
  _check_sample_ratio(sample_ratio)
  _triton_select.check_launch(span, num_warps)
  flat = x.reshape(-1)
  _check_k(flat.shape[0], k)
  if k == 0:
    return _empty(flat)
  t = _dgc_threshold(flat, k, key, sample_ratio)
  idx, _, count = _triton_select.select_at_least(
      flat, t, capacity=k, span=span, num_warps=num_warps,
      interpret=interpret)
  return _gather(flat, idx, jnp.arange(k) < count), idx


def _density_class(n: int, k: int) -> str:
  """``k / n`` to the nearest power of two, e.g. ``"2^-7"`` for 1%: top-k
  selections of about the same density share an autotuning decision."""
  return f"2^{round(math.log2(k / n))}" if k > 0 and n > 0 else "0"


def _rows_in_place(n: int, dtype) -> bool:
  """Whether the Pallas path reads ``x`` in place (:func:`_launch.to_rows`)."""
  return n > 0 and n % (8 * ROW) == 0 and jnp.dtype(dtype) == jnp.float32


def _config_params(config: TopKConfig) -> dict:
  """The knobs that differ from :data:`DEFAULT_CONFIG`, for a tuning key."""
  return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
          if getattr(config, f.name) != getattr(DEFAULT_CONFIG, f.name)}


def topk_exact_small(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """:func:`topk_reference`'s set in ascending index order (the fast path's
  contract); faster than :func:`topk_threshold_xla` on small inputs."""
  values, idx = topk_reference(x, k)
  order = jnp.argsort(idx)
  return values[order], idx[order]


# Below this many elements (by backend) the XLA path takes lax.top_k instead
# of the sampled-threshold fast path. Measured at 1% density: on an H100
# lax.top_k took 0.11 ms at 1e6 float32 elements against the fast path's
# 0.34 ms, and 1.05 ms at 2.5e7 against 0.59 ms
# (benchmarks/results/kernels_h100_f32.json); on this project's 2-core CPU
# (``python -m jaxcomp.bench kernels --sizes 3e5 524288 --ops topk``, rows
# ``reference`` and ``xla``) 3.7 ms against 5.1 ms at 3e5, and within 10% of
# each other at 524,288 (5.4 against 5.8 ms in one run, 6.7 against 5.3 in
# another), and the fast path was 11x faster at 2.5e7. The crossover between
# the measured sizes was not narrowed further.
FAST_PATH_MIN_SIZE = {"gpu": 1 << 22, "cuda": 1 << 22, "cpu": 1 << 19}


def fast_path_min_size() -> int:
  """The size from which :func:`topk_auto`'s XLA path samples a threshold
  on the default backend (``1 << 19`` where nothing was measured)."""
  return FAST_PATH_MIN_SIZE.get(jax.default_backend(), 1 << 19)


def topk_auto(x: jax.Array, k: int, *, implementation: str | None = None,
              config: TopKConfig = DEFAULT_CONFIG):
  """Exact top-k set of ``|x|`` in ascending index order: the Pallas path
  (:func:`topk`) or the XLA path (``lax.top_k`` below
  :func:`fast_path_min_size` elements, :func:`topk_threshold_xla` from
  there), by ``implementation``, or with None as
  :func:`jaxcomp.kernels.resolve_implementation` picks (XLA off NVIDIA GPUs,
  the faster one measured on an NVIDIA GPU: the earlier radix-select kernel
  was slower than the XLA path on an H100 at every size measured)."""

  def run(impl, interpret):
    if impl == "pallas":
      return lambda v: topk(v, k, config=config, interpret=interpret)
    return lambda v: _topk_xla(v, k, config)

  tunable = _autotune.Tunable(
      op="topk", n=x.size, dtype=x.dtype, run=run,
      params={"density": _density_class(x.size, k),
              "in_place": _rows_in_place(x.size, x.dtype),
              **_config_params(config)},
      supported=k > 0)
  if _autotune.resolve_implementation(implementation,
                                      tunable=tunable) == "pallas":
    return topk(x, k, config=config)
  return _topk_xla(x, k, config)


def _topk_xla(x, k, config):
  if x.size < fast_path_min_size():
    return topk_exact_small(x, k)
  return topk_threshold_xla(x, k, config=config)
