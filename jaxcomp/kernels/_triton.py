"""What the Triton-lowered kernels share, and the int8 / fp8 block kernel.

The parts every Triton kernel takes: the launch checks
(:func:`check_launch`), one masked span load (:func:`load_span`) and store
(:func:`store_span`), the word packer (:func:`pack_words`), the
``pallas_call`` launch (:func:`launch`) and the rounding numbers
(:func:`rounding_operands`, :func:`rounding_numbers`). Each op's kernel
body lives in its op's module (sign packing in :mod:`jaxcomp.kernels.sign`,
QSGD in :mod:`jaxcomp.kernels.qsgd`, top-k's selection in
:mod:`jaxcomp.kernels._topk_triton`); the int8 and fp8 blocks share one body
(:func:`block_quantize_call`), whose codes each op module passes in.

In the block kernel each Pallas program takes ``rows`` consecutive blocks
of ``block_size`` elements of the flat ``x`` with one masked load (``x`` in
its own dtype: float32, bfloat16 or float16, no converted or zero-padded
copy; reads past ``n`` give 0, as a zero-padded block would), reduces each
block's ``max|x|`` in registers, and stores the block's scale and its codes
with masked stores. ``x`` is read once and the codes written once, so the pass
moves ``n * itemsize + n + 4 * n / block_size`` bytes. The per-element
arithmetic is the op module's (``codes(y, u)``), the same jnp functions the
XLA references call, so the codes equal the reference's bit for bit.

Why Triton and not Mosaic GPU here: on an NVIDIA H200 (JAX 0.11.2,
2026-11-28, ``benchmarks/results/nvidia-h200-2026-11-28/quant_triton.txt``)
the int8 pass over 1e8 float32 took 0.146-0.152 ms, against 0.253 ms for
XLA's two passes and 0.600 ms for the Mosaic GPU kernel (whose (8, 32)
tiles, WGMMA register layout and packed-word stores cost more than the
pass moves); 500 MB in 0.149 ms is 92% of the 3.64 TB/s a copy moved in
the same run. A Triton program's masked loads also take the partial last
block and 16-bit inputs in place, which the Mosaic kernel pays a padding
copy for.

Random numbers for stochastic rounding come either as an array (read with
the same mask; uint32 bits are turned into floats in the kernel) or from a
seed (hashed from each element's flat index in the kernel,
:mod:`jaxcomp.kernels.dither`), the numbers the references draw.

Past Pallas' Triton backend. JAX 0.11 deprecated it, JAX 0.12 warns at
every lowering of one of its kernels, and a later JAX removes it. The
dispatch (``implementation=None`` and ``"pallas"``) takes these kernels
only where :func:`available` says so: where the backend is importable and
lowers without a warning (before JAX 0.12). Elsewhere the int8 and fp8
blocks' ``pallas`` path is the XLA path (faster than their Mosaic GPU
kernel on the H200, above) and the autotuner does not time a Triton
candidate; the ``*_triton`` functions called by name still build the
kernels where the backend exists (and JAX's warning is theirs), and raise
``ImportError`` where it does not. jaxcomp imports without the backend.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxcomp import _jaxcompat
from jaxcomp._jaxcompat import pallas_triton as plt

from . import _blocks
from . import _launch
from . import dither

# Blocks per program and warps per program: 8 blocks of 256 float32 (8 KiB)
# and 4 warps measured within 4% of the best of {8, 32} x {4, 8} on the H200
# at 2.5e7 and 1e8 elements, float32 and bfloat16 (quant_triton.txt).
DEFAULT_ROWS = 8
DEFAULT_WARPS = 4
# Largest span of x one program loads, in elements: Triton keeps the tile in
# registers, and 32 KiB of float32 per program of 4 warps is where register
# pressure starts to spill.
MAX_SPAN = 8192


def available() -> bool:
  """Whether the dispatch takes the Triton kernels: Pallas' Triton backend
  is in this JAX (:func:`jaxcomp._jaxcompat.pallas_triton_present`) and its
  lowering does not warn (:func:`jaxcomp._jaxcompat.pallas_triton_warns`).
  """
  return (_jaxcompat.pallas_triton_present()
          and not _jaxcompat.pallas_triton_warns())


def check_launch(block_size: int, rows: int, num_warps: int) -> None:
  """Raises ValueError naming the parameter when a launch cannot compile:
  ``block_size`` a power of two >= 32 (Triton tiles are powers of two),
  ``rows`` a power of two with ``rows * block_size <= MAX_SPAN``,
  ``num_warps`` in 1, 2, 4, 8, 16."""
  if block_size < 32 or block_size & (block_size - 1):
    raise ValueError(f"block_size={block_size} must be a power of two >= 32 "
                     "for the Triton kernel; use implementation='xla' for "
                     "other block sizes")
  if rows < 1 or rows & (rows - 1):
    raise ValueError(f"rows={rows} must be a power of two")
  if rows * block_size > MAX_SPAN:
    raise ValueError(f"rows * block_size = {rows * block_size} exceeds "
                     f"{MAX_SPAN} elements per program; pass fewer rows")
  if num_warps not in (1, 2, 4, 8, 16):
    raise ValueError(f"num_warps={num_warps} must be 1, 2, 4, 8 or 16")


def supported_block(block_size: int) -> bool:
  """Whether the Triton kernel takes blocks of ``block_size`` elements."""
  return 32 <= block_size <= MAX_SPAN and not block_size & (block_size - 1)


def default_rows(block_size: int) -> int:
  """Blocks per program: :data:`DEFAULT_ROWS`, fewer for large blocks."""
  return max(1, min(DEFAULT_ROWS, MAX_SPAN // block_size))


def load_span(x_ref, span: int, n: int):
  """This program's ``span`` consecutive elements of the flat ``x``, from
  ``start = program_id * span``, with one masked load in ``x``'s own dtype
  (reads past ``n`` give 0). Returns ``(start, offs, x)``: ``offs`` the
  elements' flat int32 indices, ``x`` float32 ``(span,)``."""
  start = pl.program_id(0) * span
  offs = start + jnp.arange(span, dtype=jnp.int32)
  x = plt.load(x_ref.at[pl.ds(start, span)], mask=offs < n, other=0)
  return start, offs, x.astype(jnp.float32)


def store_span(ref, start, values: jax.Array, limit: int) -> None:
  """Stores the 1-D ``values`` at ``ref[start:start + len(values)]``, the
  slots at or past ``limit`` left alone (a partial last program)."""
  size = values.shape[0]
  index = start + jnp.arange(size, dtype=jnp.int32)
  plt.store(ref.at[pl.ds(start, size)], values, mask=index < limit)


def pack_words(codes: jax.Array, bits: int) -> jax.Array:
  """uint32 codes (< ``2**bits``, a multiple of ``32 / bits`` of them)
  packed ``32 / bits`` per word, code ``j`` of a word at bit ``j * bits``
  (:func:`jaxcomp.kernels.bitpack.pack_bits_reference`'s layout)."""
  per = 32 // bits
  shifts = jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(bits)
  return jnp.sum(codes.reshape(-1, per) << shifts[None, :], axis=1,
                 dtype=jnp.uint32)


def launch(body: Callable, out_shape, *, programs: int, num_warps: int,
           interpret: bool, name: str):
  """``pl.pallas_call`` of ``body`` over a 1-D grid of ``programs``
  Triton programs of ``num_warps`` warps, one stage (no pipelining: each
  program loads its span once). ``out_shape`` should be typed with
  :func:`jaxcomp.kernels._launch.out_struct` (varying like ``x`` inside
  ``shard_map``)."""
  return pl.pallas_call(
      body, out_shape=out_shape, grid=(max(1, programs),),
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name=name)


def rounding_operands(uniform, seed, *, required: bool
                      ) -> tuple[tuple[jax.Array, ...], str]:
  """The kernel operands after ``x`` and the rounding's name (``"seed"``,
  ``"array"`` or ``"nearest"``, :func:`_blocks.rounding_of`, whose errors
  it raises)."""
  rounding = _blocks.rounding_of(uniform, seed, required=required)
  if rounding == "seed":
    return (seed,), rounding
  if rounding == "array":
    return (uniform.reshape(-1),), rounding
  return (), rounding


def rounding_numbers(rounding: str, r_ref, start, offs: jax.Array, n: int,
                     shape):
  """This program's rounding numbers (float32 ``shape``) for the elements
  at flat ``offs`` (``start + arange``): hashed from the seed in ``r_ref``
  or read from the array ``r_ref`` (masked as ``x`` is); None for nearest
  rounding."""
  if rounding == "seed":
    seed = (r_ref[0], r_ref[1])
    return dither.to_unit(dither.hash_bits(
        seed, offs.astype(jnp.uint32).reshape(shape)))
  if rounding == "array":
    raw = plt.load(r_ref.at[pl.ds(start, offs.shape[0])], mask=offs < n,
                   other=0)
    return _blocks.uniform_f32(raw).reshape(shape)
  return None


def _kernel(*refs, n: int, block_size: int, rows: int, top: float,
            codes: Callable, code_len: int, rounding: str):
  if rounding == "nearest":
    x_ref, q_ref, s_ref = refs
    r_ref = None
  else:
    x_ref, r_ref, q_ref, s_ref = refs
  span = rows * block_size
  start, offs, x = load_span(x_ref, span, n)
  x = x.reshape(rows, block_size)
  scale = jnp.max(jnp.abs(x), axis=1) / jnp.float32(top)
  y = x * _blocks.inverse_scales(scale)[:, None]
  u = rounding_numbers(rounding, r_ref, start, offs, n, (rows, block_size))
  store_span(q_ref, start, codes(y, u).reshape(span), code_len)
  store_span(s_ref, pl.program_id(0) * rows, scale, -(-n // block_size))


def block_quantize_call(x: jax.Array, codes: Callable, *, block_size: int,
                        top: float, code_dtype, padded: bool, name: str,
                        uniform: jax.Array | None = None,
                        seed: jax.Array | None = None,
                        rows: int | None = None,
                        num_warps: int = DEFAULT_WARPS,
                        interpret: bool = False
                        ) -> tuple[jax.Array, jax.Array]:
  """One Triton-lowered pass of block quantization.

  Args:
    x: float array of ``n`` elements (any shape; read flat, in its dtype).
    codes: ``(y, u) -> codes`` of ``y = x * (1 / scale)`` (float32 ``(rows,
      block_size)``) with rounding numbers ``u`` (same shape, or None for
      nearest rounding), in ``code_dtype``.
    block_size: elements per scale (a power of two >= 32).
    top: the code's largest magnitude (127 for int8, 448 for fp8 e4m3):
      ``scale = max|x| / top``.
    code_dtype: dtype of the codes.
    padded: codes for ``ceil(n / block_size) * block_size`` elements (the
      padding's codes 0) instead of ``n``.
    name: the kernel's name in profiles.
    uniform: ``n`` rounding numbers (floats in [0, 1) or uint32 bits), or
      None.
    seed: uint32 ``(2,)``: element ``i`` rounds with
      ``dither.to_unit(dither.hash_bits(seed, i))``; or None.
    rows: blocks per program (None: :func:`default_rows`).
    num_warps: warps per program.
    interpret: run in Pallas' interpret mode (any backend).

  Returns:
    ``(codes (n,) or (num_blocks * block_size,), scales float32
    (num_blocks,))``.

  Raises:
    ValueError: both ``uniform`` and ``seed``; a launch that cannot
      compile (:func:`check_launch`).
  """
  rows = default_rows(block_size) if rows is None else rows
  check_launch(block_size, rows, num_warps)
  extra, rounding = rounding_operands(uniform, seed, required=False)
  return _call(x.reshape(-1), *extra, codes=codes, block_size=block_size,
               top=top, code_dtype=jnp.dtype(code_dtype), padded=padded,
               name=name, rounding=rounding,
               rows=rows, num_warps=num_warps, interpret=interpret)


@functools.partial(jax.jit, static_argnames=(
    "codes", "block_size", "top", "code_dtype", "padded", "name", "rounding",
    "rows", "num_warps", "interpret"))
def _call(flat, *extra, codes, block_size, top, code_dtype, padded, name,
          rounding, rows, num_warps, interpret):
  n = flat.shape[0]
  num_blocks = -(-n // block_size)
  code_len = num_blocks * block_size if padded else n
  body = functools.partial(_kernel, n=n, block_size=block_size, rows=rows,
                           top=top, codes=codes, code_len=code_len,
                           rounding=rounding)
  return launch(
      body,
      # Typed as varying like x inside shard_map (check_vma).
      (_launch.out_struct((code_len,), code_dtype, flat),
       _launch.out_struct((num_blocks,), jnp.float32, flat)),
      programs=-(-num_blocks // rows), num_warps=num_warps,
      interpret=interpret, name=name)(flat, *extra)
