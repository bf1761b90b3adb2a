"""Top-k with a Triton-lowered selection (:func:`topk_triton`,
:func:`sampled_topk_triton`; both re-exported by :mod:`jaxcomp.kernels.topk`).

The selection by threshold: which elements of ``x`` have ``|x| >= t``,
compacted in index order into a fixed capacity, in two passes over ``x``
(``select_at_least``).

1. **Count** (:func:`count_at_least`): each Pallas program takes ``span``
   consecutive elements with one masked load and writes how many of them
   have ``key >= t`` (``key``: the bit pattern of ``|x|`` as float32, the
   order :func:`jaxcomp.kernels.topk.abs_key` defines). Reads ``n *
   itemsize`` bytes, writes 4 per program.
2. An exclusive prefix sum of the programs' counts (XLA, over ``n / span``
   int32): each program's first output slot.
3. **Compact**: each program loads its span again, ranks its selected
   elements by an in-register prefix sum, and scatters their indices and
   keys to ``offset + rank`` (slots ``>= capacity`` are dropped). Reads ``n
   * itemsize`` bytes again, writes 8 bytes per selected element.

This replaces the selection the XLA path builds from packed bit masks:
popcounts, a prefix sum over ``n / 32`` words, a scatter, a running maximum
and a select-the-r-th-bit (:mod:`jaxcomp.kernels.compact`), a dozen XLA
kernels. On an H200 the XLA path's top-k took 0.44-0.61 ms at 2.5e7
elements, 1% kept, where one read of ``x`` at the copy's rate takes 0.03 ms
(``benchmarks/results/nvidia-h200-2026-11-28``): its time is not ``x``'s
bytes. Here the selection is two kernels and one small prefix sum.

Why Triton: the scatter's addresses depend on the data, which Mosaic GPU's
tiled shared-memory stores and TMA copies do not express; Triton's masked
pointer stores do. Untimed on a GPU so far: :func:`topk_triton` is reached
only by asking for it (``benchmarks/kernels_bench.py``'s ``triton`` top-k
row), not by ``implementation=None``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxcomp._jaxcompat import pallas_triton as plt

from . import _launch
from . import _topk_select
from . import _triton
from ._topk_select import DEFAULT_CONFIG
from ._topk_select import TopKConfig

# Elements per program: 4096 float32 is 16 KiB, half of the int8 kernel's
# register budget (_triton.MAX_SPAN), leaving room for the in-register
# prefix sum's int32 ranks.
DEFAULT_SPAN = 4096
DEFAULT_WARPS = 4
MAX_SPAN = 8192


def check_launch(span: int, num_warps: int) -> None:
  """Raises ValueError naming the parameter when a launch cannot compile:
  ``span`` a power of two in [32, MAX_SPAN] (Triton tiles are powers of
  two), ``num_warps`` in 1, 2, 4, 8, 16."""
  if not 32 <= span <= MAX_SPAN or span & (span - 1):
    raise ValueError(f"span={span} must be a power of two in [32, "
                     f"{MAX_SPAN}] (elements per Triton program)")
  if num_warps not in (1, 2, 4, 8, 16):
    raise ValueError(f"num_warps={num_warps} must be 1, 2, 4, 8 or 16")


def _hits(t_ref, x_ref, *, n: int, span: int):
  """This program's element indices and their ``key >= t`` mask (elements
  past ``n`` never selected), with their keys."""
  _, offs, x = _triton.load_span(x_ref, span, n)
  key = jax.lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(0x7FFFFFFF)
  return offs, key, (key >= t_ref[0]) & (offs < n)


def _count_kernel(t_ref, x_ref, counts_ref, *, n: int, span: int):
  _, _, hit = _hits(t_ref, x_ref, n=n, span=span)
  count = jnp.sum(hit.astype(jnp.int32))
  plt.store(counts_ref.at[pl.ds(pl.program_id(0), 1)], count[None])


def _compact_kernel(t_ref, offsets_ref, x_ref, idx_ref, key_ref, *, n: int,
                    span: int, capacity: int):
  offs, key, hit = _hits(t_ref, x_ref, n=n, span=span)
  hit32 = hit.astype(jnp.int32)
  slot = offsets_ref[pl.program_id(0)] + jnp.cumsum(hit32) - hit32
  keep = hit & (slot < capacity)
  # Lanes that store nothing point past the capacity, each at its own slot:
  # a masked store skips them on a GPU, and interpret mode, which writes
  # their old values back, then cannot clobber a selected element's slot.
  slot = jnp.where(keep, slot, capacity + jnp.arange(span, dtype=jnp.int32))
  plt.store(idx_ref.at[slot], offs, mask=keep)
  plt.store(key_ref.at[slot], key, mask=keep)


def _programs(n: int, span: int) -> int:
  return max(1, -(-n // span))


@functools.partial(jax.jit, static_argnames=("span", "num_warps",
                                             "interpret"))
def count_at_least(flat: jax.Array, t: jax.Array, *, span: int = DEFAULT_SPAN,
                   num_warps: int = DEFAULT_WARPS,
                   interpret: bool = False) -> jax.Array:
  """Per program of ``span`` elements: how many have ``key >= t``.

  Args:
    flat: float ``(n,)`` (float32, bfloat16 or float16; read in its dtype).
    t: int32 scalar key threshold.
    span: elements per program.
    num_warps: warps per program.
    interpret: run in Pallas' interpret mode (any backend).

  Returns:
    int32 ``(ceil(n / span),)``.
  """
  check_launch(span, num_warps)
  n = flat.shape[0]
  return _triton.launch(
      functools.partial(_count_kernel, n=n, span=span),
      _launch.out_struct((_programs(n, span),), jnp.int32, flat),
      programs=_programs(n, span), num_warps=num_warps, interpret=interpret,
      name="jaxcomp_select_count",
  )(jnp.reshape(t, (1,)).astype(jnp.int32), flat)


@functools.partial(jax.jit, static_argnames=("capacity", "span", "num_warps",
                                             "interpret"))
def select_at_least(flat: jax.Array, t: jax.Array, *, capacity: int,
                    span: int = DEFAULT_SPAN, num_warps: int = DEFAULT_WARPS,
                    interpret: bool = False
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The elements with ``key >= t``, in ascending index order, cut to
  ``capacity``: two Triton-lowered passes over ``flat``.

  Args:
    flat: float ``(n,)`` (float32, bfloat16 or float16; read in its dtype).
    t: int32 scalar key threshold (``key``: the bit pattern of ``|x|`` as
      float32; NaN ranks above infinity).
    capacity: output slots (static, >= 1).
    span: elements per program (a power of two in [32, 8192]).
    num_warps: warps per program.
    interpret: run in Pallas' interpret mode (any backend).

  Returns:
    ``(indices int32 (capacity,), keys int32 (capacity,), count int32
    scalar)``: the first ``min(count, capacity)`` slots hold the selected
    elements' flat indices and keys in ascending index order; ``count`` is
    how many were selected (it may exceed ``capacity``). Slots past it hold
    index 0 and key -1.

  Raises:
    ValueError: ``capacity < 1``; a launch that cannot compile
      (:func:`check_launch`).
  """
  if capacity < 1:
    raise ValueError(f"capacity={capacity} must be >= 1")
  check_launch(span, num_warps)
  n = flat.shape[0]
  t = jnp.reshape(t, (1,)).astype(jnp.int32)
  counts = count_at_least(flat, t, span=span, num_warps=num_warps,
                          interpret=interpret)
  offsets = jnp.cumsum(counts) - counts
  count = jnp.sum(counts)
  idx, key = _triton.launch(
      functools.partial(_compact_kernel, n=n, span=span, capacity=capacity),
      (_launch.out_struct((capacity + span,), jnp.int32, flat),
       _launch.out_struct((capacity + span,), jnp.int32, flat)),
      programs=_programs(n, span), num_warps=num_warps, interpret=interpret,
      name="jaxcomp_select_compact",
  )(t, offsets, flat)
  live = jnp.arange(capacity) < count
  return (jnp.where(live, idx[:capacity], 0),
          jnp.where(live, key[:capacity], -1), count)


# ----------------------------------------------------------------------------
# Top-k and DGC's sampled top-k on the Triton selection.
# ----------------------------------------------------------------------------


TRITON_SPAN = DEFAULT_SPAN  # topk_triton's default span


@functools.partial(jax.jit, static_argnames=("k", "config", "span",
                                             "num_warps", "band_only",
                                             "interpret"))
def topk_triton(x: jax.Array, k: int, *, config: TopKConfig = DEFAULT_CONFIG,
                span: int = TRITON_SPAN,
                num_warps: int = DEFAULT_WARPS,
                band_only: bool = False,
                interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Exact top-k of ``|x|`` whose selection is two Triton-lowered kernels.

  The XLA fast path's selection (:func:`topk_threshold_xla`: the lower
  threshold ``t`` of an evenly spaced sample, the candidates ``key >= t``
  compacted in index order into a fixed capacity, the ``k``-th largest key
  found among them) with the compaction done by
  ``select_at_least``: a count pass and a compact pass over ``x``, which also returns the candidates' keys, in
  place of the packed masks, prefix sums, scatter and running maximum over
  ``n / 32`` words. The candidates' keys are sorted whole (one sort), or
  with ``band_only`` only those between the sample's two thresholds (the
  XLA path's way: fewer keys sorted, a few more kernels). When the sample
  misleads (fewer than ``k`` or more than the capacity pass, e.g. ties at
  ``t`` in a mostly-zero gradient) a branch runs
  :func:`topk_threshold_xla`. Same set as
  :func:`jaxcomp.kernels.topk.topk_reference`, in
  ascending index order.

  Written for NVIDIA GPUs and checked there only by its CUDA export (two
  Triton calls reading ``x``): not yet timed on one; ``implementation=None``
  times it as a candidate on an NVIDIA GPU (``topk.topk_auto``), and
  ``python benchmarks/kernels_bench.py --ops topk`` times it (rows
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
  check_launch(span, num_warps)
  flat = x.reshape(-1)
  n = flat.shape[0]
  _topk_select.check_k(n, k)
  if k == 0:
    return _topk_select.empty(flat)
  s, rank, _, cap, _ = _topk_select.sample_plan(n, k, config)
  if rank >= s or cap >= n:  # Dense selection: sampling does not pay.
    return _topk_select.topk_threshold_xla(flat, k, config=config)
  form = _topk_select.selection(config)
  stride = n // s
  top = _topk_select.sample_top_keys(flat[: s * stride : stride], rank, form)
  cidx, ckey, count = select_at_least(
      flat, top[rank - 1], capacity=cap, span=span, num_warps=num_warps,
      interpret=interpret)
  typed = lambda idx: idx + _launch.zero_like(flat, jnp.int32)

  def from_candidates():
    return typed(_topk_select.among_candidates(
        cidx, jnp.arange(cap) < count, ckey, top, k, config, n=n,
        log_depth=form == "partial", band_only=band_only))

  def misled():
    return typed(_topk_select.topk_threshold_xla(flat, k, config=config)[1])

  idx = jax.lax.cond((count >= k) & (count <= cap), from_candidates, misled)
  return _topk_select.gather(flat, idx), idx


@functools.partial(jax.jit, static_argnames=("k", "sample_ratio", "span",
                                             "num_warps", "interpret"))
def sampled_topk_triton(x: jax.Array, k: int, key: jax.Array, *,
                        sample_ratio: float, span: int = TRITON_SPAN,
                        num_warps: int = DEFAULT_WARPS,
                        interpret: bool = False
                        ) -> tuple[jax.Array, jax.Array]:
  """:func:`jaxcomp.kernels.topk.sampled_topk` (DGC) with its selection
  done by the two Triton-lowered kernels of :func:`topk_triton`
  (``select_at_least`` with capacity ``k``): the same threshold from the same sample, the same values and
  indices.

  Not yet timed on a GPU; ``implementation=None`` times it as a candidate
  on an NVIDIA GPU (``topk.sampled_topk``; ``python
  benchmarks/kernels_bench.py --ops sampled_topk``, row ``pallas:triton``).

  Returns:
    ``(values[k] in x.dtype, indices[k] int32)``.

  Raises:
    ValueError: ``sample_ratio`` not in (0, 1], bad ``k``, ``span`` or
      ``num_warps``.
  """
  _topk_select.check_sample_ratio(sample_ratio)
  check_launch(span, num_warps)
  flat = x.reshape(-1)
  _topk_select.check_k(flat.shape[0], k)
  if k == 0:
    return _topk_select.empty(flat)
  t = _topk_select.dgc_threshold(flat, k, key, sample_ratio)
  idx, _, count = select_at_least(
      flat, t, capacity=k, span=span, num_warps=num_warps,
      interpret=interpret)
  return _topk_select.gather(flat, idx, jnp.arange(k) < count), idx
