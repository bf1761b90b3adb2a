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
# (jaxcomp/kernels/quantize.py; the structure is tested from the CUDA export in
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


# The block the kernel body being traced runs on, where blocked_call maps
# it (a persistent grid); None: the grid step is the block.
_current_block: list = [None]


def block_index(interpret: bool) -> jax.Array:
  """int32 number of the block running (the operands' block of
  :func:`blocked_call`: on a persistent grid, not the CUDA block)."""
  if _current_block[0] is not None:
    return _current_block[0]
  return pl.program_id(0) if interpret else jax.lax.axis_index("blocks")


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


def _on_block(kernel, block):
  """``kernel`` with :func:`block_index` returning ``block`` while it is
  traced."""

  def run(*refs):
    _current_block[0] = block() if callable(block) else block
    try:
      kernel(*refs)
    finally:
      _current_block[0] = None

  return run


# Interpret mode runs a persistent grid of this many workers where set (a
# test of the GPU path's block order on a CPU); None: the plain grid.
INTERPRET_WORKERS: int | None = None


def persistent_grid(grid: int, workers: int | None = None):
  """The :class:`PersistentGrid` for ``grid`` blocks, or None where there
  are no more blocks than workers (default :func:`sm_count`)."""
  workers = sm_count() if workers is None else workers
  return PersistentGrid(grid, workers) if grid > workers else None


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
                 interpret: bool, name: str, workers: int | None = None):
  """A kernel over a 1-D grid of ``grid`` blocks, as ``pl.pallas_call`` has it.

  ``kernel(*in_block_refs, *out_block_refs)`` sees one block of each operand
  per grid step, cut by the ``BlockSpec``s (index maps take the block number;
  :func:`block_index` gives it inside ``kernel``).

  * ``interpret=True``: ``pl.pallas_call(..., interpret=True)`` (any backend).
  * Otherwise Mosaic GPU through its public kernel API, which JAX 0.11
    requires (``pl.pallas_call`` no longer lowers Mosaic GPU compiler
    parameters there), on a persistent grid when there are more blocks than
    ``workers`` (default :func:`sm_count`): ``plgpu.kernel`` launches one
    CUDA block per SM, and each runs ``plgpu.emit_pipeline`` over its share
    of the blocks (:class:`PersistentGrid`) with up to
    :data:`MAX_PIPELINE_STAGES` blocks in flight (as many as fit shared
    memory, :func:`pipeline_stages`), so TMA copies the next blocks into
    shared memory while the current one computes. With fewer blocks, one
    CUDA block per block.

  ``workers`` (or :data:`INTERPRET_WORKERS`) with ``interpret=True`` runs
  the persistent grid's block order in interpret mode (a ``(workers, steps)`` grid whose steps
  map to blocks as on the GPU, the repeats past the end included), so that
  the mapping is tested on a CPU.

  Returns:
    A function of the input arrays returning ``out_shape``'s structure.
  """
  multiple = isinstance(out_shape, (list, tuple))
  if interpret:
    workers = INTERPRET_WORKERS if workers is None else workers
    plan = None if workers is None else persistent_grid(grid, workers)
    if plan is None:
      return pl.pallas_call(kernel, grid=(grid,), in_specs=in_specs,
                            out_specs=out_specs, out_shape=out_shape,
                            interpret=True, name=name)
    return pl.pallas_call(
        _on_block(kernel, lambda: plan.block(pl.program_id(0), pl.program_id(1))),
        grid=(plan.workers, plan.steps),
        in_specs=[plan.spec(s) for s in in_specs],
        out_specs=([plan.spec(s) for s in out_specs] if multiple
                   else plan.spec(out_specs)),
        out_shape=out_shape, interpret=True, name=name)
  out_type = tuple(out_shape) if multiple else out_shape
  out_list = list(out_specs) if multiple else [out_specs]
  num_out = len(out_list)
  plan = persistent_grid(grid, workers)
  if plan is not None:
    return lambda *args: _persistent_call(kernel, out_type, out_list, plan,
                                          in_specs, args)

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


def _block_bytes(spec, dtype) -> int:
  size = 1
  for d in spec.block_shape:
    size *= getattr(d, "block_size", d)
  return size * jnp.dtype(dtype).itemsize


def _persistent_call(kernel, out_type, out_list, plan: PersistentGrid,
                     in_specs, args):
  """:func:`blocked_call` on a persistent grid, for the operands ``args``."""
  outs = out_type if isinstance(out_type, tuple) else (out_type,)
  step_bytes = (sum(_block_bytes(s, a.dtype) for s, a in zip(in_specs, args))
                + sum(_block_bytes(s, o.dtype) for s, o in zip(out_list, outs)))
  stages = pipeline_stages(step_bytes, plan.steps)
  num_out = len(out_list)

  def body(*refs):
    in_refs, out_refs = refs[:len(refs) - num_out], refs[len(refs) - num_out:]
    worker = jax.lax.axis_index("blocks")

    def step(indices, *block_refs):
      _on_block(kernel, plan.block(worker, indices[0]))(*block_refs)

    plgpu.emit_pipeline(
        step, grid=(plan.steps,),
        in_specs=[plan.spec(s, worker) for s in in_specs],
        out_specs=[plan.spec(s, worker) for s in out_list],
        max_concurrent_steps=stages)(*in_refs, *out_refs)

  return plgpu.kernel(body, out_type=out_type, compiler_params=compiler_params(),
                      grid=(plan.workers,), grid_names=("blocks",))(*args)
