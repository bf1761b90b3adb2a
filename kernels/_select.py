"""Implementation selection and the row layout shared by the Pallas kernels.

``resolve_implementation`` decides between the Pallas kernels and the pure-XLA
references: ``"xla"`` off NVIDIA GPUs, and on one the path measured faster for
the op and size, unless the caller names one explicitly.

The kernels in this folder all read a flat array as rows of 32 float32 values
(128 bytes, one swizzle period), ``block_rows`` rows per grid step. On Mosaic
GPU a block is copied to shared memory by TMA with an (8, 32) tiling and a
128-byte swizzle and loaded into registers in the WGMMA layout, which supports
reductions along the row (axis 1) and broadcasts of per-row values. In
interpret mode (CPU) the layout casts are skipped: they change no value.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

IMPLEMENTATIONS = ("pallas", "xla")
ROW = 32  # float32 values per row: 128 bytes.


def nvidia_gpu() -> bool:
  """Whether the default backend is an NVIDIA GPU (Mosaic GPU's target)."""
  if jax.default_backend() not in ("gpu", "cuda"):
    return False
  version = getattr(jax.devices()[0].client, "platform_version", "")
  return "rocm" not in str(version).lower()


# On an NVIDIA GPU, ``implementation=None`` takes the path that the last GPU
# measurement and the structural model agree on (H100, JAX 0.11.2; the
# command and its output are in benchmarks/results/kernels_h100_f32.txt, the
# rows in kernels_h100_f32.json). That measurement found the earlier Pallas
# sign kernel 1.8x faster than XLA at 1e8 float32 elements read in place, and
# the QSGD, int8 and top-k kernels slower than XLA at every size. The
# quantize kernels have since been rewritten to read x once
# (kernels/quantize.py; the structure is tested from the CUDA export in
# tests/test_kernel_structure.py) and have not run on a GPU: no measurement
# describes them, so the default is XLA for every op until one does.
# ``SIGN_KERNEL_MIN_SIZE`` is the size from which the measured sign kernel
# paid, kept for the next measurement to confirm or move.
SIGN_KERNEL_MIN_SIZE = 1 << 22
MEASURED_PALLAS_OPS: frozenset = frozenset()  # ops whose current kernel won


def _gpu_default(op: str | None, n: int | None, dtype) -> str:
  if (op in MEASURED_PALLAS_OPS and op == "sign" and n is not None
      and n >= SIGN_KERNEL_MIN_SIZE and n % (8 * ROW) == 0
      and jnp.dtype(dtype) == jnp.float32):
    return "pallas"
  return "xla"


def resolve_implementation(implementation: str | None, *, op: str | None = None,
                           n: int | None = None, dtype=jnp.float32) -> str:
  """Returns ``"pallas"`` or ``"xla"``.

  Args:
    implementation: ``"pallas"``, ``"xla"`` or ``None``. ``None`` picks
      ``"xla"`` off NVIDIA GPUs (CPU, TPU, ROCm: Mosaic GPU kernels do not
      compile there), and on an NVIDIA GPU the path measured faster for
      ``op`` at ``n`` elements of ``dtype`` with the current kernels (none
      yet: see ``MEASURED_PALLAS_OPS``).
    op: ``"sign"``, ``"qsgd"``, ``"int8"``, ``"fp8"``, ``"topk"`` or ``"sampled_topk"``.
    n: element count of the input.
    dtype: the input's dtype.

  Raises:
    ValueError: ``implementation`` is not one of the above.
  """
  if implementation is None:
    return _gpu_default(op, n, dtype) if nvidia_gpu() else "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation must be one of {IMPLEMENTATIONS} or None, got "
        f"{implementation=}")
  return implementation


def check_block_rows(block_rows: int) -> None:
  if block_rows <= 0 or block_rows % 64:
    raise ValueError(
        f"{block_rows=} must be a positive multiple of 64 (one WGMMA row tile)")


def to_rows(x: jax.Array, block_rows: int, *, interpret: bool = False):
  """Flattens ``x`` to float32 rows of 32 without a copy where it can.

  Returns ``(rows, grid)``: ``rows`` of shape ``(num_rows, 32)`` and
  ``grid = ceil(num_rows / block_rows)`` blocks. A float32 ``x`` whose size
  is a multiple of 256 (whole (8, 32) TMA tiles) is only reshaped (free),
  and the last block may be partial: on GPU, TMA fills the rows past the end
  with zeros on load and drops them on store. Any other input is converted
  and zero-padded (one copy) to a multiple of 256, or to whole blocks in
  interpret mode, whose reads past the end are not zeros.
  """
  n = x.size
  flat = x.reshape(-1)
  if flat.dtype == jnp.float32 and n % (8 * ROW) == 0 and n and not interpret:
    num_rows = n // ROW
    return flat.reshape(num_rows, ROW), -(-num_rows // block_rows)
  per_block = block_rows * ROW
  grid = max(1, -(-n // per_block))
  tile = 8 * ROW
  padded = grid * per_block if interpret else max(tile, -(-n // tile) * tile)
  flat = jnp.pad(flat.astype(jnp.float32), (0, padded - n))
  return flat.reshape(padded // ROW, ROW), -(-(padded // ROW) // block_rows)


def pad_rows_vector(v: jax.Array, num_rows: int) -> jax.Array:
  """A per-row vector of exactly ``num_rows`` entries: ``v`` zero-padded or
  cut (per-bucket values repeated per row can run past the last row)."""
  if v.shape[0] >= num_rows:
    return v[:num_rows]
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


def row_iota(block_rows: int, interpret: bool) -> jax.Array:
  """uint32 row index ``0..block_rows-1`` of each element of a row block."""
  return wgmma(
      jax.lax.broadcasted_iota(jnp.uint32, (block_rows, ROW), 0), interpret)


def block_index(interpret: bool) -> jax.Array:
  """int32 number of the grid step running (the block of :func:`blocked_call`)."""
  return pl.program_id(0) if interpret else jax.lax.axis_index("blocks")


def compiler_params():
  """Mosaic GPU compiler parameters of every kernel here.

  The kernels are written for the Lane lowering semantics (explicit register
  layouts through :func:`wgmma`); JAX 0.11 made Warpgroup the default, so the
  semantics are named.
  """
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def out_struct(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
  """Output type of a kernel that varies over the manual mesh axes that
  ``like`` varies over, so that kernels work inside ``jax.shard_map`` with
  ``check_vma=True`` (which requires ``manual_axis_type`` on outputs)."""
  return jax.ShapeDtypeStruct(shape, dtype,
                              manual_axis_type=jax.typeof(like).mat)


def zero_like(like: jax.Array, dtype) -> jax.Array:
  """A scalar zero of ``dtype`` typed as ``like`` is over the manual mesh
  axes (varying where it varies, inside ``jax.shard_map``), computed from
  ``like`` itself so that no mesh-axis helper is needed: e.g. a loop carry
  that a kernel output will replace."""
  return jnp.zeros_like(like, shape=(), dtype=dtype)


def blocked_call(kernel, out_shape, *, grid: int, in_specs, out_specs,
                 interpret: bool, name: str):
  """A kernel over a 1-D grid of ``grid`` blocks, as ``pl.pallas_call`` has it.

  ``kernel(*in_block_refs, *out_block_refs)`` sees one block of each operand
  per grid step, cut by the ``BlockSpec``s (index maps take the block number).

  * ``interpret=True``: ``pl.pallas_call(..., interpret=True)`` (any backend).
  * Otherwise Mosaic GPU through its public kernel API, which JAX 0.11
    requires (``pl.pallas_call`` no longer lowers Mosaic GPU compiler
    parameters there): ``plgpu.kernel`` launches one CUDA block per grid
    step and ``plgpu.emit_pipeline`` copies each operand's block between
    global and shared memory with TMA around ``kernel``.

  Returns:
    A function of the input arrays returning ``out_shape``'s structure.
  """
  if interpret:
    return pl.pallas_call(kernel, grid=(grid,), in_specs=in_specs,
                          out_specs=out_specs, out_shape=out_shape,
                          interpret=True, name=name)
  multiple = isinstance(out_shape, (list, tuple))
  out_type = tuple(out_shape) if multiple else out_shape
  out_list = list(out_specs) if multiple else [out_specs]
  num_out = len(out_list)

  def at_this_block(spec):
    index_map = spec.index_map
    return dataclasses.replace(
        spec, index_map=lambda: index_map(jax.lax.axis_index("blocks")))

  def body(*refs):
    in_refs, out_refs = refs[:len(refs) - num_out], refs[len(refs) - num_out:]
    pipeline = plgpu.emit_pipeline(
        lambda _, *block_refs: kernel(*block_refs), grid=(),
        in_specs=[at_this_block(s) for s in in_specs],
        out_specs=[at_this_block(s) for s in out_list])
    pipeline(*in_refs, *out_refs)

  return plgpu.kernel(body, out_type=out_type, compiler_params=compiler_params(),
                      grid=(grid,), grid_names=("blocks",))
