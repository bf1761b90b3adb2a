"""What XLA runs around the quantize kernels, read from the CUDA export.

Each quantize path is exported with ``jax.export`` for CUDA (no GPU needed)
and its StableHLO walked by :mod:`jaxcomp.hlo.kernel_structure`. For float32
inputs whose length is a whole number of the kernel's (8, bucket) tiles the
targets hold: ``x`` is read once, by the kernel; no ``n``-sized XLA op runs
before or after it (no transpose of the codes, no pad, no concatenate, no
reduction for norms / scales, no multiplier vector); no random numbers are
materialized; bfloat16 and float16 inputs of whole tiles are read in place
too. Inputs that are not whole tiles pay one conversion / padding copy on the
Mosaic GPU kernels (none on the kernels lowered by Triton); the test prints
what remains for them (run with ``-s``) and checks that it is only that copy.
"""

import jax
import jax.numpy as jnp
import pytest

from jaxcomp import _jaxcompat
from jaxcomp.compressors import block_quant
from jaxcomp.compressors import qsgd
from jaxcomp.kernels import _launch
from jaxcomp.kernels import _triton
from jaxcomp.kernels import QuantizeConfig
from jaxcomp.kernels import fp8_block
from jaxcomp.kernels import int8_block
from jaxcomp.kernels import qsgd as qsgd_kernel
from jaxcomp.kernels import sign as sign_kernel
from jaxcomp.hlo import kernel_structure as structure

S = jax.ShapeDtypeStruct
N_TILED = 1 << 17  # whole (8, 512) tiles: every bucket size below
N_ODD = 100_003
SEED = S((2,), jnp.uint32)
KEY = S((2,), jnp.uint32)  # a raw key


def _paths(n, dtype=jnp.float32):
  x = S((n,), dtype)
  return {
      "sign_pack": (lambda x: sign_kernel.sign_pack(x), (x,)),
      "qsgd_2bit_b32": (lambda x, s: qsgd_kernel.qsgd_quantize(
          x, levels=1, bucket_size=32, seed=s), (x, SEED)),
      "qsgd_4bit_b128": (lambda x, s: qsgd_kernel.qsgd_quantize(
          x, levels=7, bucket_size=128, seed=s), (x, SEED)),
      "qsgd_8bit_b256": (lambda x, s: qsgd_kernel.qsgd_quantize(
          x, levels=127, bucket_size=256, seed=s), (x, SEED)),
      "qsgd_16bit_b512": (lambda x, s: qsgd_kernel.qsgd_quantize(
          x, levels=4000, bucket_size=512, seed=s), (x, SEED)),
      "int8_nearest_b256": (lambda x: int8_block.int8_block_quantize(
          x, block_size=256), (x,)),
      "int8_stochastic_b256": (lambda x, s: int8_block.int8_block_quantize(
          x, block_size=256, seed=s), (x, SEED)),
      "int8_stochastic_b128": (lambda x, s: int8_block.int8_block_quantize(
          x, block_size=128, seed=s), (x, SEED)),
      "fp8_e4m3_nearest_b256": (lambda x: fp8_block.fp8_block_quantize(
          x, block_size=256), (x,)),
      "fp8_e5m2_stochastic_b128": (lambda x, s: fp8_block.fp8_block_quantize(
          x, block_size=128, format="e5m2", seed=s), (x, SEED)),
      # The compressors' encode on the Pallas path, from a JAX key.
      "QSGD.encode": (lambda x, k: qsgd.QSGD(implementation="pallas").encode(
          x, jax.random.wrap_key_data(k)), (x, KEY)),
      "FP8Block.encode_stochastic": (
          lambda x, k: block_quant.FP8Block(
              rounding="stochastic", implementation="pallas").encode(
                  x, jax.random.wrap_key_data(k)), (x, KEY)),
      "IntBlock.encode_stochastic": (
          lambda x, k: block_quant.IntBlock(
              rounding="stochastic", implementation="pallas").encode(
                  x, jax.random.wrap_key_data(k)), (x, KEY)),
  }


# The block compressors' ``pallas`` path is the kernel lowered by Triton
# (jaxcomp.kernels._triton): one masked pass that reads partial tiles and
# 16-bit inputs in place, launched as one program per 8 blocks (no
# persistent grid).
TRITON_PATHS = {"IntBlock.encode_stochastic", "FP8Block.encode_stochastic"}


@pytest.fixture(autouse=True)
def _triton_where_the_backend_is(monkeypatch):
  """The block compressors' ``pallas`` path takes the Triton kernel
  wherever Pallas' Triton backend is present, also on a JAX whose lowering
  of it warns (where the dispatch otherwise takes XLA): its structure is
  checked there too."""
  monkeypatch.setattr(_triton, "available", _jaxcompat.pallas_triton_present)


def _structure(name, n, dtype=jnp.float32):
  fn, args = _paths(n, dtype)[name]
  return structure.export_structure(fn, *args)


@pytest.mark.parametrize("name", sorted(_paths(N_TILED)))
def test_whole_tiles_read_x_once_and_nothing_n_sized_around(name):
  s = _structure(name, N_TILED)
  info = f"{name} n={N_TILED}: {s.summary()}"
  print(info)
  assert s.kernels == 1, info
  assert s.kernel_reads_of_x == 1, info  # x read by the kernel ...
  assert s.x_reads == [], info  # ... and by no XLA op
  assert s.before == [], info  # no norm reduction, pad, multiplier vector
  assert s.after == [], info  # no transpose of the codes, no slice
  assert s.random == [], info  # no rng op, no n-sized counter iota
  assert s.other_kernel_operands == 0, info  # no uniform array, no multipliers


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", sorted(_paths(N_TILED)))
def test_16_bit_whole_tiles_are_read_in_place(name, dtype):
  """bfloat16 and float16 inputs of whole tiles go to the kernel in their
  own dtype (64-byte swizzled tiles, converted to float32 in registers): no
  conversion copy before it, half the bytes of reading a float32 copy."""
  s = _structure(name, N_TILED, dtype)
  info = f"{name} n={N_TILED} {jnp.dtype(dtype).name}: {s.summary()}"
  print(info)
  assert s.kernels == 1 and s.kernel_reads_of_x == 1, info
  assert s.x_reads == [] and s.before == [] and s.after == [], info
  assert s.random == [] and s.other_kernel_operands == 0, info


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", sorted(_paths(N_ODD)))
def test_partial_tiles_pay_one_padding_copy(name, dtype):
  """What remains for inputs that are not whole tiles or not float32: the
  input is converted / zero-padded once before the kernel (XLA fuses the
  conversion into the pad) and the outputs are cut to length after it."""
  s = _structure(name, N_ODD, dtype)
  info = f"{name} n={N_ODD} {jnp.dtype(dtype).name}: {s.summary()}"
  print(info)
  assert s.kernels == 1 and s.kernel_reads_of_x == 1, info
  assert s.random == [] and s.other_kernel_operands == 0, info
  if name in TRITON_PATHS:  # masked loads: no copy of x at all
    assert s.x_reads == [] and s.before == [], info
    assert set(s.after) <= {"stablehlo.slice"}, info
    return
  assert set(s.x_reads) <= {"stablehlo.convert", "stablehlo.pad"}, info
  assert s.count("x_reads", "pad") == 1, info
  allowed_after = {"stablehlo.slice"}
  assert set(s.after) <= allowed_after, info
  for op in ("transpose", "concatenate", "reduce"):
    assert s.count("before", op) == 0 and s.count("after", op) == 0, info


def test_fallback_bucket_sizes_are_reported():
  """Bucket sizes the one-pass kernel does not take (96: 3 rows, which do
  not divide the block) and uniform arrays still work, with XLA's norm
  reduction and a multiplier vector before the kernel: the counter shows
  them, as it showed them for every size before the one-pass kernel."""
  x = S((N_TILED,), jnp.float32)
  s = structure.export_structure(
      lambda x, s: qsgd_kernel.qsgd_quantize(x, levels=7, bucket_size=96, seed=s),
      x, SEED)
  info = str(s.summary())
  print("qsgd bucket 96:", info)
  assert s.count("before", "reduce") == 1, info
  assert s.other_kernel_operands == 1, info  # the per-row multipliers
  s = structure.export_structure(
      lambda x, u: qsgd_kernel.qsgd_quantize(x, u, levels=7, bucket_size=128),
      x, x)
  print("qsgd uniform array:", s.summary())
  assert s.before == [] and s.other_kernel_operands == 1, s.summary()


def test_counter_sees_the_old_structure():
  """The counter on a hand-written module of the old QSGD path: a norm
  reduction reads x before the kernel, a multiplier vector and a uniform
  array go in, and the codes are transposed after it."""
  text = """
  func.func public @main(%arg0: tensor<8192xf32>, %arg1: tensor<8192xf32>) -> (tensor<1024xui32>) {
    %0 = stablehlo.multiply %arg0, %arg0 : tensor<8192xf32>
    %1 = stablehlo.reshape %0 : (tensor<8192xf32>) -> tensor<64x128xf32>
    %2 = stablehlo.reduce(%1 init: %cst) applies stablehlo.add across dimensions = [1] : (tensor<64x128xf32>, tensor<f32>) -> tensor<64xf32>
    %3 = stablehlo.broadcast_in_dim %2, dims = [0] : (tensor<64xf32>) -> tensor<64x4xf32>
    %4 = stablehlo.reshape %3 : (tensor<64x4xf32>) -> tensor<256xf32>
    %5 = stablehlo.reshape %arg0 : (tensor<8192xf32>) -> tensor<256x32xf32>
    %6 = stablehlo.iota dim = 0 : tensor<8192xui32>
    %7 = stablehlo.custom_call @mosaic_gpu_v2(%5, %4, %arg1) {backend_config = "x : y"} : (tensor<256x32xf32>, tensor<256xf32>, tensor<8192xf32>) -> tensor<4x256xui32>
    %8 = stablehlo.transpose %7, dims = [1, 0] : (tensor<4x256xui32>) -> tensor<256x4xui32>
    %9 = stablehlo.reshape %8 : (tensor<256x4xui32>) -> tensor<1024xui32>
    return %9 : tensor<1024xui32>
  }
  """
  s = structure.analyze(text, 8192)
  assert s.kernels == 1 and s.kernel_reads_of_x == 1
  assert s.x_reads == ["stablehlo.multiply", "stablehlo.reduce"]
  assert s.count("before", "broadcast_in_dim") == 1
  assert s.random == ["stablehlo.iota"]
  assert s.other_kernel_operands == 2
  assert s.after == ["stablehlo.transpose"]


@pytest.mark.parametrize("n", [1 << 20, 1_000_003])
def test_topk_reads_x_once_outside_its_fallback(n):
  """The Pallas top-k: on every call one mask kernel reads x (writing the
  packed masks > t and == t together) and XLA reads only the evenly spaced
  sample (a strided slice of 16,384 or 65,536 elements); the radix select
  runs only in the branch taken when the sample misleads. What follows the
  kernel works on the n / 32 mask words and the candidates."""
  from jaxcomp.kernels import topk
  x = S((n,), jnp.float32)
  s = structure.export_structure(lambda v: topk.topk(v, n // 100), x)
  info = f"topk n={n}: {s.summary()}"
  print(info)
  assert s.kernels == 1 and s.kernel_reads_of_x == 1, info
  assert s.branch_kernel_reads_of_x >= 1, info  # the exact fallback
  allowed = {"stablehlo.slice"} | ({"stablehlo.convert", "stablehlo.pad"}
                                   if n % 256 else set())
  assert set(s.x_reads) <= allowed and s.count("x_reads", "slice") == 1, info
  assert s.random == [] and s.other_kernel_operands == 0, info
  for op in ("sort", "transpose", "concatenate"):
    assert s.count("before", op) == 0 and s.count("after", op) == 0, info


def test_kernel_operation_counts():
  """Operations per block inside the kernels (their interpret-mode jaxprs):
  the in-kernel dither of stochastic rounding adds work over nearest
  rounding, sign packing does the least, and top-k's mask pass runs on
  every call while its radix count kernel sits in the fallback branch."""
  x = S((N_TILED,), jnp.float32)
  cfg = QuantizeConfig(block_rows=64)
  one = lambda f, *a: structure.kernel_ops(f, *a)
  sign, = one(lambda v: sign_kernel.sign_pack(v, config=cfg, interpret=True), x)
  near, = one(lambda v: int8_block.int8_block_quantize(
      v, block_size=256, config=cfg, interpret=True), x)
  stoch, = one(lambda v, s: int8_block.int8_block_quantize(
      v, block_size=256, seed=s, config=cfg, interpret=True), x, SEED)
  print({k.name: round(k.per_input_element, 1) for k in (sign, near)},
        "stochastic", round(stoch.per_input_element, 1))
  assert near.block_input_elements == 64 * 256 == stoch.block_input_elements
  assert sign.per_input_element < near.per_input_element < stoch.per_input_element
  assert stoch.by_primitive.get("shift_right_logical", 0) > 0  # the hash
  assert near.by_primitive.get("shift_right_logical", 0) == 0
  from jaxcomp.kernels import topk
  ks = structure.kernel_ops(lambda v: topk.topk(v, N_TILED // 100, interpret=True), x)
  every = [k for k in ks if not k.in_branch]
  assert [k.name for k in every] == ["jaxcomp_topk_mask"]
  assert any(k.name == "jaxcomp_topk_count" and k.in_branch for k in ks)


N_LARGE = 1 << 24  # 2,048 blocks of 8,192 elements: many per SM


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", sorted(set(_paths(N_LARGE)) - TRITON_PATHS))
def test_many_blocks_run_on_a_persistent_pipelined_grid(name, dtype):
  """More blocks than SMs: the kernel launches one CUDA block per SM (an
  H100's 132 when exported on a CPU), each looping over its blocks with
  emit_pipeline (the loop is in the kernel), within an H100 block's shared
  memory (227 KiB) with 2 or 3 blocks in flight. Few blocks: one CUDA
  block per block, no loop."""
  fn, args = _paths(N_LARGE, dtype)[name]
  (launch,) = structure.kernel_launches(fn, *args)
  print(name, jnp.dtype(dtype).name, launch)
  assert launch.grid == (_launch.DEFAULT_SM_COUNT, 1, 1), launch
  assert launch.loops >= 1, launch
  assert launch.shared_bytes <= 227 * 1024, launch
  fn, args = _paths(N_TILED, dtype)[name]
  (launch,) = structure.kernel_launches(fn, *args)
  assert launch.grid[0] < _launch.DEFAULT_SM_COUNT and launch.loops == 0, launch


def test_kernel_launches_reads_every_kernel_of_a_module():
  """Every Mosaic GPU kernel of a module is read, those inside a loop or a
  conditional's branch too: top-k's mask kernel and its fallback's radix
  count kernels (the walk keeps the parsed module alive while it reads the
  calls' operations)."""
  from jaxcomp.kernels import topk
  launches = structure.kernel_launches(lambda v: topk.topk(v, 1000),
                                       S((1 << 20,), jnp.float32))
  assert len(launches) >= 2, launches
  for launch in launches:
    assert launch.threads == (128, 1, 1), launch
    assert launch.grid[0] >= 1 and launch.grid[1:] == (1, 1), launch
    assert launch.shared_bytes is not None and 0 < launch.shared_bytes <= 227 * 1024, launch


def test_pipeline_stages_fit_shared_memory():
  assert _launch.pipeline_stages(36 * 1024, 100) == 3
  assert _launch.pipeline_stages(84 * 1024, 100) == 2  # 3 would need 252 KiB
  assert _launch.pipeline_stages(150 * 1024, 100) == 1
  assert _launch.pipeline_stages(1024, 2) == 2  # no more stages than steps
