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

Where the parts live: this module holds the reference, the Pallas path's
wrapper, DGC's sampled top-k and the dispatch (:func:`topk_auto`), and
re-exports the rest: the selection every path shares and the XLA path
(:mod:`jaxcomp.kernels._topk_select`), the Mosaic GPU mask and radix-select
kernels (:mod:`jaxcomp.kernels._topk_mosaic`) and the Triton-lowered
selection (:mod:`jaxcomp.kernels._topk_triton`: :func:`topk_triton`,
:func:`sampled_topk_triton`).

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

Finding ``T`` (both paths share
:func:`jaxcomp.kernels._topk_select.sampled_select`): the threshold of
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
* Pallas (GPU, :mod:`jaxcomp.kernels._topk_mosaic`): the mask pass is one
  kernel that writes ``key > t`` and ``key == t`` together (so ``x`` is
  read once on every call, and the ties branch needs nothing more); the
  exact branch is a radix select over the 31-bit key, ``radix_bits`` bits
  per pass, each pass one kernel that counts, per block, the elements with
  ``key >= base + c * 2**shift`` for all digits ``c`` (7 passes of 5 bits),
  then one more mask kernel. The
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

from . import _autotune
from . import _launch
from . import _topk_mosaic
from . import _topk_select
from . import _triton
from . import compact
from ._topk_mosaic import count_ge
from ._topk_mosaic import radix_passes
from ._topk_mosaic import radix_select
from ._topk_mosaic import threshold_masks
from ._topk_select import DEFAULT_CONFIG
from ._topk_select import SAMPLE_SIZE
from ._topk_select import SELECTION
from ._topk_select import SELECTIONS
from ._topk_select import TopKConfig
from ._topk_select import abs_key
from ._topk_select import sample_size
from ._topk_select import selection
from ._topk_select import topk_threshold_xla
from ._topk_triton import TRITON_SPAN
from ._topk_triton import sampled_topk_triton
from ._topk_triton import topk_triton

__all__ = [
    "DEFAULT_CONFIG", "FAST_PATH_MIN_SIZE", "ROW", "SAMPLE_SIZE", "SELECTION",
    "SELECTIONS", "TRITON_SPAN", "TopKConfig", "abs_key", "count_ge",
    "fast_path_min_size", "radix_passes", "radix_select", "sample_size",
    "sampled_topk", "sampled_topk_triton", "selection", "threshold_masks",
    "topk", "topk_auto", "topk_exact_small", "topk_reference",
    "topk_threshold_xla", "topk_triton",
]

ROW = _launch.ROW


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
  _topk_select.check_k(flat.shape[0], k)
  if k == 0:
    return _topk_select.empty(flat)
  a = _topk_select.abs_f32(flat)
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
# Pallas path (Mosaic GPU kernels: :mod:`jaxcomp.kernels._topk_mosaic`).
# ----------------------------------------------------------------------------


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
  _topk_select.check_k(n, k)
  if k == 0:
    return _topk_select.empty(flat)
  rows, _ = _launch.to_rows(flat, config.block_rows)
  log_depth = selection(config) == "partial"

  def exact_from_top_k():
    t = radix_select(rows, k, block_rows=config.block_rows,
                     radix_bits=config.radix_bits, interpret=interpret)
    gt, eq = threshold_masks(rows, t, block_rows=config.block_rows,
                             interpret=interpret)
    words = _topk_select.exact_words(_topk_mosaic.live_words(gt, n),
                                     _topk_mosaic.live_words(eq, n), k,
                                     log_depth)
    idx, _ = compact.compact(words, k, log_depth=log_depth)
    return idx

  def masks(t):
    gt, eq = threshold_masks(rows, t, block_rows=config.block_rows,
                             interpret=interpret)
    gt = _topk_mosaic.live_words(gt, n)
    return gt | _topk_mosaic.live_words(eq, n), lambda: gt

  idx = _topk_select.sampled_select(flat, k, config, masks, exact_from_top_k)
  return _topk_select.gather(flat, idx), idx


# ----------------------------------------------------------------------------
# DGC sampled top-k.
# ----------------------------------------------------------------------------


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
  with None as :func:`jaxcomp.kernels.resolve_implementation` picks, which
  also times :func:`sampled_topk_triton`'s Triton selection where
  ``jaxcomp.kernels._triton.available()`` and ``config`` is the default).

  Returns:
    ``(values[k] in x.dtype, indices[k] int32)``.

  Raises:
    ValueError: ``sample_ratio`` not in (0, 1] or bad ``k``.
  """
  _topk_select.check_sample_ratio(sample_ratio)
  _topk_select.check_k(x.size, k)

  def run(impl, interpret):
    if impl == "triton":
      return lambda v, key_: sampled_topk_triton(
          v, k, key_, sample_ratio=sample_ratio, interpret=bool(interpret))
    return lambda v, key_: _sampled_topk(
        v, k, key_, sample_ratio=sample_ratio, config=config,
        implementation="pallas" if impl == "mosaic" else impl,
        interpret=interpret)

  tunable = _autotune.Tunable(
      op="sampled_topk", n=x.size, dtype=x.dtype, run=run,
      extras=lambda v: (jax.random.key(2),),
      params={"density": _density_class(x.size, k),
              "sample_ratio": sample_ratio,
              "in_place": _rows_in_place(x.size, x.dtype),
              **_config_params(config)},
      supported=k > 0,
      # The Triton selection has no TopKConfig: a candidate for the default.
      candidates=_autotune.candidates(
          mosaic=True,
          triton=_triton.available() and config == DEFAULT_CONFIG))
  implementation = _autotune.resolve_implementation(implementation,
                                                    tunable=tunable)
  return run(implementation, interpret)(x, key)


@functools.partial(jax.jit, static_argnames=("k", "sample_ratio", "config",
                                             "implementation", "interpret"))
def _sampled_topk(x, k, key, *, sample_ratio, config, implementation,
                  interpret):
  flat = x.reshape(-1)
  if k == 0:
    return _topk_select.empty(flat)
  t = _topk_select.dgc_threshold(flat, k, key, sample_ratio)
  if implementation == "pallas":
    _launch.check_block_rows(config.block_rows)
    rows, _ = _launch.to_rows(flat, config.block_rows)
    gt, eq = threshold_masks(rows, t, block_rows=config.block_rows,
                             interpret=interpret)
    words = gt | eq
  else:
    words = _topk_select.words_xla(flat, lambda kk: kk >= t)
  idx, valid = compact.compact(words, k,
                               log_depth=selection(config) == "partial")
  return _topk_select.gather(flat, idx, valid), idx


# ----------------------------------------------------------------------------
# Dispatch by implementation.
# ----------------------------------------------------------------------------


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
# (``python benchmarks/kernels_bench.py --sizes 3e5 524288 --ops topk``, rows
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
  the fastest measured on an NVIDIA GPU of the XLA path, the Mosaic GPU
  kernels and, where ``jaxcomp.kernels._triton.available()``,
  :func:`topk_triton`: the earlier radix-select kernel was slower than the
  XLA path on an H100 at every size measured)."""

  def run(impl, interpret):
    if impl in ("pallas", "mosaic"):
      return lambda v: topk(v, k, config=config, interpret=interpret)
    if impl == "triton":
      return lambda v: topk_triton(v, k, config=config,
                                   interpret=bool(interpret))
    return lambda v: _topk_xla(v, k, config)

  tunable = _autotune.Tunable(
      op="topk", n=x.size, dtype=x.dtype, run=run,
      params={"density": _density_class(x.size, k),
              "in_place": _rows_in_place(x.size, x.dtype),
              **_config_params(config)},
      supported=k > 0,
      candidates=_autotune.candidates(mosaic=True,
                                      triton=_triton.available()))
  return run(_autotune.resolve_implementation(implementation,
                                              tunable=tunable), False)(x)


def _topk_xla(x, k, config):
  if x.size < fast_path_min_size():
    return topk_exact_small(x, k)
  return topk_threshold_xla(x, k, config=config)
