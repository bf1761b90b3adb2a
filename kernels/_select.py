"""Implementation selection and the row layout shared by the Pallas kernels.

``resolve_implementation`` decides between the Pallas kernels and the pure-XLA
references: ``"pallas"`` on a GPU backend, ``"xla"`` everywhere else, unless the
caller names one explicitly.

The kernels in this folder all read a flat array as rows of 32 float32 values
(128 bytes, one swizzle period), ``block_rows`` rows per grid step. On Mosaic
GPU a block is copied to shared memory by TMA with an (8, 32) tiling and a
128-byte swizzle and loaded into registers in the WGMMA layout, which supports
reductions along the row (axis 1) and broadcasts of per-row values. In
interpret mode (CPU) the layout casts are skipped: they change no value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

IMPLEMENTATIONS = ("pallas", "xla")
ROW = 32  # float32 values per row: 128 bytes.


def _is_cuda() -> bool:
  """Whether the default backend is an NVIDIA GPU (Mosaic GPU's target)."""
  if jax.default_backend() not in ("gpu", "cuda"):
    return False
  version = getattr(jax.devices()[0].client, "platform_version", "")
  return "rocm" not in str(version).lower()


def resolve_implementation(implementation: str | None) -> str:
  """Returns ``"pallas"`` or ``"xla"``.

  Args:
    implementation: ``"pallas"``, ``"xla"`` or ``None``. ``None`` picks
      ``"pallas"`` when the default JAX backend is an NVIDIA GPU and
      ``"xla"`` otherwise (CPU, TPU, ROCm).

  Raises:
    ValueError: ``implementation`` is not one of the above.
  """
  if implementation is None:
    return "pallas" if _is_cuda() else "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation must be one of {IMPLEMENTATIONS} or None, got "
        f"{implementation=}")
  return implementation


def check_block_rows(block_rows: int) -> None:
  if block_rows <= 0 or block_rows % 64:
    raise ValueError(
        f"{block_rows=} must be a positive multiple of 64 (one WGMMA row tile)")


def to_rows(x: jax.Array, block_rows: int, fill: float = 0.0):
  """Flattens ``x`` to float32 rows of 32, padded to whole blocks.

  Returns ``(rows, grid)`` with ``rows`` of shape ``(grid * block_rows, 32)``.
  """
  n = x.size
  per_block = block_rows * ROW
  grid = max(1, -(-n // per_block))
  flat = x.reshape(-1).astype(jnp.float32)
  flat = jnp.pad(flat, (0, grid * per_block - n), constant_values=fill)
  return flat.reshape(grid * block_rows, ROW), grid


def pad_rows_vector(v: jax.Array, num_rows: int) -> jax.Array:
  """Pads a per-row vector with zeros to ``num_rows`` entries."""
  return jnp.pad(v, (0, num_rows - v.shape[0]))


def rows_spec(block_rows: int, interpret: bool):
  """BlockSpec of a ``(block_rows, 32)`` float32 block of a row array."""
  index_map = lambda i: (i, 0)
  if interpret:
    return pl.BlockSpec((block_rows, ROW), index_map)
  return plgpu.BlockSpec(
      (block_rows, ROW), index_map,
      transforms=(plgpu.TilingTransform((8, ROW)), plgpu.SwizzleTransform(128)))


def vector_spec(block_rows: int):
  """BlockSpec of one block of a per-row vector of shape ``(num_rows,)``."""
  return pl.BlockSpec((block_rows,), lambda i: (i,))


def wgmma(x: jax.Array, interpret: bool) -> jax.Array:
  """Casts a ``(block_rows, 32)`` value to the WGMMA register layout."""
  return x if interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def wgmma_row(x: jax.Array, interpret: bool) -> jax.Array:
  """Casts a ``(block_rows,)`` value to the layout of a WGMMA row reduction."""
  return x if interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))


def column_iota(block_rows: int, interpret: bool) -> jax.Array:
  """uint32 column index ``0..31`` of each element of a row block."""
  return wgmma(
      jax.lax.broadcasted_iota(jnp.uint32, (block_rows, ROW), 1), interpret)


def compiler_params():
  return plgpu.CompilerParams()
