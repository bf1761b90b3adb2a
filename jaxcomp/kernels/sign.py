"""Sign (1-bit) packing: the Pallas kernel, its XLA reference and dispatch.

Wire format (Bernstein et al, signSGD <https://arxiv.org/abs/1802.04434>,
2018, with the mean-magnitude scale of Karimireddy et al, EF-SGD, 2019):
bit 1 for ``x < 0``, 0 otherwise (-0.0 gives 0), packed 32 per uint32 with
``bits=1`` (:mod:`jaxcomp.kernels.bitpack`); ``scale = mean(|x|)`` in
float32. Decode: ``scale * (1 - 2 * bit)``. A NaN gets bit 0 (``NaN < 0`` is
false) and makes the scale non-finite.

The kernel (:func:`sign_pack`) packs the bits and sums ``|x|`` per group of
8, 4, 2 or 1 rows of 32 (the widest whose (8, group) tiles ``n`` fills, so
that a float32 ``x`` of such a length is read in place; XLA adds those
``n / group`` sums for the scale), in one pass over ``x``. Groups of fewer
than 4 rows write their words word-major and XLA transposes them (``n /
32`` words). The layout and launch are those of every quantizer
(:mod:`jaxcomp.kernels._blocks_mosaic`). :func:`sign_pack_triton` packs the
same words in one Triton-lowered pass (:func:`_triton_kernel`).
"""

from __future__ import annotations

import functools
from typing import cast

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxcomp._jaxcompat import pallas_triton as plt

from . import _autotune
from . import _blocks
from . import _blocks_mosaic
from . import _launch
from . import _triton
from ._blocks import DEFAULT_CONFIG
from ._blocks import QuantizeConfig
from .bitpack import pack_bits_reference
from .bitpack import packed_words
from .bitpack import unpack_bits_reference

ROW = _launch.ROW


# ----------------------------------------------------------------------------
# Reference (pure jnp): the XLA path and the ground truth of the kernel.
# ----------------------------------------------------------------------------


def sign_pack_reference(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """1-bit sign packing in XLA.

  Args:
    x: float array of ``n`` elements (any shape; flattened).

  Returns:
    ``(words uint32 (ceil(n / 32),), scale float32 ())``.
  """
  flat = x.reshape(-1)
  bits = (flat < 0).astype(jnp.uint32)
  scale = jnp.mean(jnp.abs(flat.astype(jnp.float32)))
  return pack_bits_reference(bits, 1), scale


def sign_unpack_reference(words: jax.Array, scale: jax.Array, n: int) -> jax.Array:
  """Inverse of :func:`sign_pack_reference`: float32 ``(n,)``."""
  bit = unpack_bits_reference(words, 1, n).astype(jnp.float32)
  return scale * (1.0 - 2.0 * bit)


# ----------------------------------------------------------------------------
# Pallas (Mosaic GPU) kernel.
# ----------------------------------------------------------------------------


def _sign_plan(n: int, block_rows: int) -> _blocks_mosaic.Plan:
  """Sign packing groups rows only to shrink its per-group ``|x|`` sums: the
  widest group of 8, 4, 2 or 1 rows whose (8, group) tiles ``n`` fills, else
  8 rows (and a padding copy)."""
  for g in (8, 4, 2, 1):
    if n % (8 * ROW * g) == 0:
      break
  else:
    g = 8
  return _blocks_mosaic.Plan(group=g * ROW,
                             block_groups=max(64, block_rows // g),
                             in_kernel=True)


def _sign_kernel(x_ref, words_ref, abs_sums_ref, *, plan: _blocks_mosaic.Plan,
                 word_major: bool, block: _launch.Block):
  """Sign bits (``x < 0``) packed 32 per word, and each group's sum of
  ``|x|`` (``abs_sums_ref (B,) f32``: XLA adds them for the scale)."""
  xs = _blocks_mosaic.columns(x_ref, plan, block)
  abs_sums_ref[...] = _blocks_mosaic.row_total([jnp.abs(v) for v in xs],
                                               jnp.sum, jnp.add)
  col = block.column_iota(plan.block_groups)
  shift = _blocks_mosaic.word_shift(col, 1)
  for k, x in enumerate(xs):
    _blocks_mosaic.store_words((x < 0).astype(jnp.uint32), k, words_ref,
                               col=col, shift=shift, bits=1,
                               word_major=word_major, block=block)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def sign_pack(x: jax.Array, *, config: QuantizeConfig = DEFAULT_CONFIG,
              interpret: bool | _launch.Interpret = False
              ) -> tuple[jax.Array, jax.Array]:
  """Pallas sign packing: the words of :func:`sign_pack_reference`, and its
  scale up to float32 summation order (the kernel sums ``|x|`` per group of
  rows as it packs, so the scale costs no second pass over ``x``).

  Args:
    x: float array of ``n`` elements (any shape; flattened).
    config: kernel block size.
    interpret: run the kernel in interpret mode (any backend); a
      :class:`jaxcomp.kernels.Interpret` for its options.

  Returns:
    ``(words uint32 (ceil(n / 32),), scale float32 ())``.

  Raises:
    ValueError: ``config.block_rows`` not a positive multiple of 64.
  """
  _launch.check_block_rows(config.block_rows)
  n = x.size
  plan = _sign_plan(n, config.block_rows)
  xg, grid = _blocks_mosaic.to_groups(x, plan)
  words, group_abs = _blocks_mosaic.pack_call(
      _sign_kernel, xg, None, None, None, name="jaxcomp_sign_pack",
      stat_name="abs_sums_ref", bits=1, plan=plan, grid=grid,
      interpret=interpret)
  # The sign plan reduces in the kernel: the statistic is there.
  scale = jnp.sum(cast(jax.Array, group_abs)) / jnp.float32(n)
  return words[:packed_words(n, 1)], scale


# ----------------------------------------------------------------------------
# Triton kernel.
# ----------------------------------------------------------------------------

# Rows of 32 elements (one uint32 word each) per Triton program.
TRITON_ROWS = 128


def _triton_kernel(x_ref, words_ref, abs_sums_ref, *, n: int, rows: int):
  """One Triton program of sign packing: loads ``rows * 32`` elements of
  the flat ``x`` (in its dtype; reads past ``n`` give 0, whose bit is 0 as
  the reference's padding), packs bit ``x < 0`` of element ``32 i + j`` as
  bit ``j`` of word ``i`` (:mod:`jaxcomp.kernels.bitpack`) and writes its
  sum of ``|x|`` (``abs_sums_ref``, one float32 per program: XLA adds the
  sums for the scale)."""
  pid = pl.program_id(0)
  _, _, x = _triton.load_span(x_ref, rows * 32, n)
  _triton.store_span(words_ref, pid * rows,
                     _triton.pack_words((x < 0).astype(jnp.uint32), 1),
                     -(-n // 32))
  plt.store(abs_sums_ref.at[pl.ds(pid, 1)], jnp.sum(jnp.abs(x))[None])


@functools.partial(jax.jit, static_argnames=("rows", "num_warps",
                                             "interpret"))
def _triton_call(flat, *, rows, num_warps, interpret):
  """``(words uint32 (ceil(n / 32),), abs_sums float32 (programs,))`` of
  the flat ``x`` (``n >= 1``) by :func:`_triton_kernel`."""
  n = flat.shape[0]
  words = -(-n // 32)
  programs = max(1, -(-words // rows))
  return _triton.launch(
      functools.partial(_triton_kernel, n=n, rows=rows),
      (_launch.out_struct((words,), jnp.uint32, flat),
       _launch.out_struct((programs,), jnp.float32, flat)),
      programs=programs, num_warps=num_warps, interpret=interpret,
      name="jaxcomp_sign_triton")(flat)


def sign_pack_triton(x: jax.Array, *, rows: int = TRITON_ROWS,
                     num_warps: int = _triton.DEFAULT_WARPS,
                     interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Sign packing lowered by Triton: the words of
  :func:`sign_pack_reference` bit for bit, and its scale up to float32
  summation order, in one masked pass over ``x`` in its own dtype (no
  padded or converted copy; :func:`_triton_kernel`).

  Written after the int8 kernel of the same form measured 1.7-2.1x XLA on
  an H200 (docs/kernels.md), where the Mosaic kernel (:func:`sign_pack`)
  was 1.94x XLA at 1e8 float32 but 0.77x at 2.5e7; not yet timed on a GPU
  itself: ``implementation="pallas"`` is the Mosaic kernel, and
  ``implementation=None`` times this one as a candidate on an NVIDIA GPU
  (:func:`sign_pack_auto`; ``python benchmarks/kernels_bench.py --ops
  sign``, row ``pallas:triton``).

  Args:
    x: float32, bfloat16 or float16 array of ``n`` elements (any shape).
    rows: uint32 words (rows of 32 elements) per program, a power of two
      up to 256.
    num_warps: warps per program (1, 2, 4, 8 or 16).
    interpret: run in Pallas' interpret mode (any backend).

  Returns:
    ``(words uint32 (ceil(n / 32),), scale float32 ())``.

  Raises:
    ValueError: bad ``rows`` or ``num_warps``.
  """
  _triton.check_launch(32, rows, num_warps)
  if x.size == 0:
    return sign_pack_reference(x)
  words, abs_sums = _triton_call(x.reshape(-1), rows=rows,
                                 num_warps=num_warps, interpret=interpret)
  return words, jnp.sum(abs_sums) / jnp.float32(x.size)


# ----------------------------------------------------------------------------
# Dispatch by implementation.
# ----------------------------------------------------------------------------


def sign_pack_auto(x, *, implementation: str | None = None):
  """Sign packing through a kernel or the reference: ``implementation``
  (``"pallas"``: the Mosaic GPU kernel, :func:`sign_pack`), or with None
  the one :func:`jaxcomp.kernels.resolve_implementation` picks (XLA off
  NVIDIA GPUs; on an NVIDIA GPU the fastest measured of XLA, the Mosaic GPU
  kernel and, where ``jaxcomp.kernels._triton.available()``, the Triton
  kernel, :func:`sign_pack_triton`).

  Returns:
    As :func:`sign_pack_reference`.
  """
  kernels = {"pallas": sign_pack, "mosaic": sign_pack,
             "triton": sign_pack_triton}

  def run(impl, interpret):
    if impl in kernels:
      return lambda v: kernels[impl](v, interpret=interpret)
    return sign_pack_reference

  tunable = _autotune.Tunable(
      op="sign", n=x.size, dtype=x.dtype, run=run,
      params={"in_place": _blocks.in_place(x.size, ROW, x.dtype)},
      candidates=_autotune.candidates(mosaic=True,
                                      triton=_triton.available()))
  return run(_autotune.resolve_implementation(implementation,
                                              tunable=tunable), False)(x)
