"""The launch framework of the Pallas kernels: row layout, block specs, and
:func:`blocked_call`, which runs a kernel body over a 1-D grid of blocks,
compiled for Mosaic GPU or in interpret mode.

The kernels in this folder all read a flat array as rows of 32 float32 values
(128 bytes, one swizzle period), ``block_rows`` rows per grid step. On Mosaic
GPU a block is copied to shared memory by TMA with an (8, 32) tiling and a
128-byte swizzle and loaded into registers in the WGMMA layout, which supports
reductions along the row (axis 1) and broadcasts of per-row values.

A kernel body is written once for both targets. It takes its refs by name
(``kernel(x_ref=..., words_ref=..., block=...)``: the names given to
:func:`blocked_call`) and a :class:`Block`, which gives the number of the block
it runs on and the register layout casts of the target. ``interpret`` is a
concern of :func:`blocked_call` alone: in interpret mode it strips the TMA
transforms from the block specs, zero-fills the inputs to whole blocks (as TMA
fills reads past the end on a GPU) and hands the kernel a :class:`Block` whose
layout casts change nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxcomp._jaxcompat import manual_type
from jaxcomp._jaxcompat import store_unplanned

ROW = 32  # float32 values per row: 128 bytes.


def nvidia_gpu() -> bool:
  """Whether the default backend is an NVIDIA GPU (Mosaic GPU's target)."""
  if jax.default_backend() not in ("gpu", "cuda"):
    return False
  version = getattr(jax.devices()[0].client, "platform_version", "")
  return "rocm" not in str(version).lower()


def check_block_rows(block_rows: int) -> None:
  if block_rows <= 0 or block_rows % 64:
    raise ValueError(
        f"{block_rows=} must be a positive multiple of 64 (one WGMMA row tile)")


def to_rows(x: jax.Array, block_rows: int):
  """Flattens ``x`` to float32 rows of 32 without a copy where it can.

  Returns ``(rows, grid)``: ``rows`` of shape ``(num_rows, 32)`` and
  ``grid = ceil(num_rows / block_rows)`` blocks. A float32 ``x`` whose size
  is a multiple of 256 (whole (8, 32) TMA tiles) is only reshaped (free),
  and the last block may be partial: TMA fills the rows past the end with
  zeros on load and drops them on store (:func:`blocked_call` does the same
  in interpret mode). Any other input is converted and zero-padded (one
  copy) to a multiple of 256.
  """
  n = x.size
  flat = x.reshape(-1)
  if flat.dtype == jnp.float32 and n % (8 * ROW) == 0 and n:
    num_rows = n // ROW
    return flat.reshape(num_rows, ROW), -(-num_rows // block_rows)
  tile = 8 * ROW
  padded = max(tile, -(-n // tile) * tile)
  flat = jnp.pad(flat.astype(jnp.float32), (0, padded - n))
  return flat.reshape(padded // ROW, ROW), -(-(padded // ROW) // block_rows)


def pad_rows_vector(v: jax.Array, num_rows: int) -> jax.Array:
  """A per-row vector of exactly ``num_rows`` entries: ``v`` zero-padded or
  cut (per-bucket values repeated per row can run past the last row)."""
  if v.shape[0] >= num_rows:
    return v[:num_rows]
  return jnp.pad(v, (0, num_rows - v.shape[0]))


def tiled_spec(block_shape: tuple[int, int], index_map,
               dtype=jnp.float32) -> plgpu.BlockSpec:
  """BlockSpec of a 2-D block whose column slices of 32 are loaded as
  ``(rows, 32)`` register tiles: TMA copies it in (8, 32) tiles with the
  swizzle of one tile row (128 bytes for float32, 64 for 16-bit types).
  :func:`blocked_call` drops the transforms in interpret mode."""
  # JAX 0.12 derives the transforms from the typing.Protocol
  # ``plgpu.Transform``, whose unimplemented ``transform_array`` pyright
  # takes for abstract; both classes are concrete (and TMA needs no
  # transform_array).
  return plgpu.BlockSpec(
      block_shape, index_map,
      transforms=(
          plgpu.TilingTransform((8, ROW)),  # pyright: ignore[reportAbstractUsage]
          plgpu.SwizzleTransform(  # pyright: ignore[reportAbstractUsage]
              ROW * jnp.dtype(dtype).itemsize)))


def rows_spec(block_rows: int) -> plgpu.BlockSpec:
  """BlockSpec of a ``(block_rows, 32)`` float32 block of a row array."""
  return tiled_spec((block_rows, ROW), lambda i: (i, 0))


def vector_spec(block_rows: int):
  """BlockSpec of one block of a per-row vector of shape ``(num_rows,)``."""
  return pl.BlockSpec((block_rows,), lambda i: (i,))


@dataclasses.dataclass(frozen=True)
class Block:
  """What a kernel body knows of the block it runs on; :func:`blocked_call`
  passes one as ``block=``.

  Attributes:
    index: int32 number of the block (the operands' block, as their
      ``BlockSpec`` index maps take it: on a persistent grid not the CUDA
      block), computed where the body asks for it.
    compiled: whether the body is lowered for Mosaic GPU (register layouts
      are cast) or interpreted (the casts change no value and are skipped).
  """
  index_fn: Callable[[], jax.Array]
  compiled: bool

  @property
  def index(self) -> jax.Array:
    return self.index_fn()

  def tile(self, x: jax.Array) -> jax.Array:
    """Casts a ``(rows, 32)`` value to the WGMMA register layout."""
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA) if self.compiled else x

  def store(self, ref, value: jax.Array) -> None:
    """Writes ``value`` to ``ref``, a kernel ref or a view of one such as
    ``ref.at[:, k]`` (a column of a 2-D output block: a strided store of a
    per-row value), as ``ref[...] = value`` does in interpret mode; on
    Mosaic GPU without asking for a bank-conflict-free transfer plan
    (:func:`jaxcomp._jaxcompat.store_unplanned`)."""
    if self.compiled:
      store_unplanned(ref, value)
    else:
      ref[...] = value

  def row(self, x: jax.Array) -> jax.Array:
    """Casts a ``(rows,)`` value to the layout of a WGMMA row reduction."""
    if self.compiled:
      return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))
    return x

  def column_iota(self, rows: int) -> jax.Array:
    """uint32 column index ``0..31`` of each element of a row block."""
    return self.tile(jax.lax.broadcasted_iota(jnp.uint32, (rows, ROW), 1))

  def row_iota(self, rows: int) -> jax.Array:
    """uint32 row index ``0..rows-1`` of each element of a row block."""
    return self.tile(jax.lax.broadcasted_iota(jnp.uint32, (rows, ROW), 0))


@dataclasses.dataclass(frozen=True)
class Interpret:
  """Interpret mode with options, for a kernel's ``interpret=`` argument
  (``interpret=True`` is ``Interpret()``), as ``pallas_call`` takes its
  interpret parameters.

  Attributes:
    workers: run the blocks in the order of a persistent grid of this many
      workers (as the GPU path does with more blocks than SMs: a test of
      that order on a CPU); None: the plain grid.
  """
  workers: int | None = None


# A persistent grid launches this many CUDA blocks (one per SM: an H100
# SXM's 132 where no GPU says otherwise, e.g. when exporting on a CPU)
# when there are more blocks than that.
DEFAULT_SM_COUNT = 132
# Blocks in flight per CUDA block of a persistent grid (emit_pipeline's
# stages): up to this many, as many as fit SHARED_BYTES.
MAX_PIPELINE_STAGES = 3
SHARED_BYTES = 227 * 1024 - 2048  # an H100 block's opt-in dynamic shared
#                                   memory, less room for barriers/alignment


def pipeline_stages(step_bytes: int, steps: int) -> int:
  """Stages of a persistent grid's pipeline whose one step holds
  ``step_bytes`` of blocks in shared memory (each stage buffers one step):
  as many as fit :data:`SHARED_BYTES`, at most :data:`MAX_PIPELINE_STAGES`
  and ``steps``, at least 1."""
  return max(1, min(MAX_PIPELINE_STAGES, steps, SHARED_BYTES // max(1, step_bytes)))


def sm_count() -> int:
  """Streaming multiprocessors of the default NVIDIA GPU, else
  :data:`DEFAULT_SM_COUNT`."""
  if nvidia_gpu():
    count = getattr(jax.devices()[0], "core_count", None)
    if isinstance(count, int) and count > 0:
      return count
  return DEFAULT_SM_COUNT


class PersistentGrid:
  """Blocks ``0..grid-1`` spread over ``workers`` persistent workers (CUDA
  blocks): worker ``w``'s step ``i`` runs block ``min(w + i * workers,
  grid - 1)``. The last worker steps past the end repeat the last block;
  the kernels here write each block's outputs from that block's inputs
  only, so the repeat writes the same values again."""

  def __init__(self, grid: int, workers: int):
    self.grid, self.workers = grid, workers
    self.steps = -(-grid // workers)

  def block(self, worker, step):
    return jnp.minimum(worker + step * self.workers, self.grid - 1)

  def spec(self, spec, worker=None):
    """``spec`` with its index map taking ``worker``'s step, or with
    ``worker=None`` the ``(worker, step)`` pair of a 2-D grid."""
    index_map = spec.index_map
    if worker is None:
      return dataclasses.replace(
          spec, index_map=lambda w, i: index_map(self.block(w, i)))
    return dataclasses.replace(
        spec, index_map=lambda i: index_map(self.block(worker, i)))


def persistent_grid(grid: int, workers: int | None = None):
  """The :class:`PersistentGrid` for ``grid`` blocks, or None where there
  are no more blocks than workers (default :func:`sm_count`)."""
  workers = sm_count() if workers is None else workers
  return PersistentGrid(grid, workers) if grid > workers else None


def compiler_params():
  """Mosaic GPU compiler parameters of every kernel here.

  The kernels are written for the Lane lowering semantics (explicit register
  layouts through :meth:`Block.tile`); JAX 0.11 made Warpgroup the default,
  so the semantics are named.
  """
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def out_struct(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
  """Output type of a kernel that varies over the manual mesh axes that
  ``like`` varies over, so that kernels work inside ``jax.shard_map`` with
  ``check_vma=True`` (which requires ``manual_axis_type`` on outputs)."""
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual_type(like))


def zero_like(like: jax.Array, dtype) -> jax.Array:
  """A scalar zero of ``dtype`` typed as ``like`` is over the manual mesh
  axes (varying where it varies, inside ``jax.shard_map``), computed from
  ``like`` itself so that no mesh-axis helper is needed: e.g. a loop carry
  that a kernel output will replace."""
  return jnp.zeros_like(like, shape=(), dtype=dtype)


Inputs = Sequence[tuple[str, Any]]  # (ref name, BlockSpec)
Outputs = Sequence[tuple[str, jax.ShapeDtypeStruct, Any]]  # (name, type, spec)


def blocked_call(kernel, *, grid: int, inputs: Inputs, outputs: Outputs,
                 name: str, interpret: bool | Interpret = False,
                 workers: int | None = None):
  """A kernel over a 1-D grid of ``grid`` blocks, as ``pl.pallas_call`` has it.

  ``kernel(**refs, block=Block)`` sees one block of each operand per grid
  step, by the names in ``inputs`` and ``outputs``, cut by their
  ``BlockSpec``s (index maps take the block number, which
  :attr:`Block.index` gives inside ``kernel``).

  * Compiled (``interpret`` false): Mosaic GPU through its public kernel
    API, which JAX 0.11 requires (``pl.pallas_call`` no longer lowers
    Mosaic GPU compiler parameters there), on a persistent grid when there
    are more blocks than ``workers`` (default :func:`sm_count`):
    ``plgpu.kernel`` launches one CUDA block per SM, and each runs
    ``plgpu.emit_pipeline`` over its share of the blocks
    (:class:`PersistentGrid`) with up to :data:`MAX_PIPELINE_STAGES`
    blocks in flight (as many as fit shared memory, :func:`pipeline_stages`),
    so TMA copies the next blocks into shared memory while the current one
    computes. With fewer blocks, one CUDA block per block.
  * ``interpret=True`` or :class:`Interpret`: ``pl.pallas_call(...,
    interpret=True)`` on any backend, the inputs zero-filled to whole
    blocks first (a GPU's TMA reads zeros past the end; interpret mode's own
    padding is not zeros) and the specs without their TMA transforms. With
    ``Interpret(workers=w)`` (or ``workers``) the blocks run in a persistent
    grid's order (a ``(workers, steps)`` grid whose steps map to blocks as
    on the GPU, the repeats past the end included), so that the mapping is
    tested on a CPU.

  Returns:
    A function of the input arrays (in ``inputs``' order) returning the
    tuple of outputs (in ``outputs``' order).
  """
  in_names = [n for n, _ in inputs]
  in_specs = [s for _, s in inputs]
  out_names = [n for n, _, _ in outputs]
  out_type = tuple(t for _, t, _ in outputs)
  out_specs = [s for _, _, s in outputs]
  names = in_names + out_names

  def named(refs, block):
    kernel(**dict(zip(names, refs)), block=block)

  if interpret:
    options = interpret if isinstance(interpret, Interpret) else Interpret()
    workers = options.workers if workers is None else workers
    return _interpret_call(named, out_type, in_specs, out_specs, grid=grid,
                           name=name, workers=workers)
  plan = persistent_grid(grid, workers)
  if plan is not None:
    return lambda *args: _persistent_call(named, out_type, out_specs, plan,
                                          in_specs, args)

  def at_this_block(spec):
    index_map = spec.index_map
    return dataclasses.replace(
        spec, index_map=lambda: index_map(jax.lax.axis_index("blocks")))

  num_out = len(out_specs)
  block = Block(index_fn=lambda: jax.lax.axis_index("blocks"), compiled=True)

  def body(*refs):
    in_refs, out_refs = refs[:len(refs) - num_out], refs[len(refs) - num_out:]
    pipeline = plgpu.emit_pipeline(
        lambda _, *block_refs: named(block_refs, block), grid=(),
        in_specs=[at_this_block(s) for s in in_specs],
        out_specs=[at_this_block(s) for s in out_specs])
    pipeline(*in_refs, *out_refs)

  return plgpu.kernel(body, out_type=out_type, compiler_params=compiler_params(),
                      grid=(grid,), grid_names=("blocks",))


def _plain_spec(spec):
  """``spec`` without Mosaic GPU's TMA transforms (interpret mode)."""
  return pl.BlockSpec(spec.block_shape, spec.index_map)


def _zero_fill(x: jax.Array, spec) -> jax.Array:
  """``x`` zero-padded to whole blocks of ``spec`` in every dimension."""
  pads = [(0, -(-d // b) * b - d) for d, b in zip(x.shape, spec.block_shape)]
  return jnp.pad(x, pads) if any(p for _, p in pads) else x


def _interpret_call(named, out_type, in_specs, out_specs, *, grid: int,
                    name: str, workers: int | None):
  """:func:`blocked_call` in interpret mode."""
  in_specs = [_plain_spec(s) for s in in_specs]
  out_specs = [_plain_spec(s) for s in out_specs]
  plan = None if workers is None else persistent_grid(grid, workers)
  if plan is None:
    block = Block(index_fn=lambda: pl.program_id(0), compiled=False)
    call_grid = (grid,)
  else:
    block = Block(index_fn=lambda: plan.block(pl.program_id(0),
                                              pl.program_id(1)),
                  compiled=False)
    call_grid = (plan.workers, plan.steps)
    in_specs = [plan.spec(s) for s in in_specs]
    out_specs = [plan.spec(s) for s in out_specs]
  call = pl.pallas_call(lambda *refs: named(refs, block), grid=call_grid,
                        in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_type, interpret=True, name=name)
  # The zero fill reads the unmapped specs' block shapes (the same).
  shapes = [_plain_spec(s) for s in in_specs]
  return lambda *args: call(*[_zero_fill(a, s) for a, s in zip(args, shapes)])


def _block_bytes(spec, dtype) -> int:
  size = 1
  for d in spec.block_shape:
    size *= getattr(d, "block_size", d)
  return size * jnp.dtype(dtype).itemsize


def _persistent_call(named, out_type, out_specs, plan: PersistentGrid,
                     in_specs, args):
  """:func:`blocked_call` on a persistent grid, for the operands ``args``."""
  step_bytes = (sum(_block_bytes(s, a.dtype) for s, a in zip(in_specs, args))
                + sum(_block_bytes(s, o.dtype) for s, o in zip(out_specs, out_type)))
  stages = pipeline_stages(step_bytes, plan.steps)
  num_out = len(out_specs)

  def body(*refs):
    in_refs, out_refs = refs[:len(refs) - num_out], refs[len(refs) - num_out:]
    worker = jax.lax.axis_index("blocks")

    def step(indices, *block_refs):
      index = plan.block(worker, indices[0])
      named(block_refs, Block(index_fn=lambda: index, compiled=True))

    plgpu.emit_pipeline(
        step, grid=(plan.steps,),
        in_specs=[plan.spec(s, worker) for s in in_specs],
        out_specs=[plan.spec(s, worker) for s in out_specs],
        max_concurrent_steps=stages)(*in_refs, *out_refs)

  return plgpu.kernel(body, out_type=out_type, compiler_params=compiler_params(),
                      grid=(plan.workers,), grid_names=("blocks",))(*args)
