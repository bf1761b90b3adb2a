"""Every Pallas kernel lowers for CUDA (Mosaic GPU), checked on a CPU machine.

``jax.export.export(..., platforms=["cuda"])`` runs the Mosaic GPU lowering
(layouts, TMA transfers, shared-memory budget) without a GPU. Each case also
asserts that the exported module really holds a Mosaic GPU kernel call, so a
silent fallback to XLA would fail here.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxcomp.kernels import int8_block
from jaxcomp.kernels import qsgd
from jaxcomp.kernels import sign
from jaxcomp.kernels import topk

S = jax.ShapeDtypeStruct
N = 100_003  # not a multiple of the block
N_TILED = 100_096  # whole (8, 32) tiles, not whole blocks: no padding copy


def _cases():
  f32 = S((N,), jnp.float32)
  f32_tiled = S((1 << 17,), jnp.float32)
  seed = S((2,), jnp.uint32)
  return {
      "sign_pack_f32": (lambda x: sign.sign_pack(x), (f32,)),
      "sign_pack_bf16": (lambda x: sign.sign_pack(x),
                         (S((N,), jnp.bfloat16),)),
      "qsgd_4bit": (lambda x, u: qsgd.qsgd_quantize(
          x, u, levels=7, bucket_size=512), (f32, f32)),
      "qsgd_16bit_u32": (lambda x, u: qsgd.qsgd_quantize(
          x, u, levels=4000, bucket_size=256), (f32, S((N,), jnp.uint32))),
      "int8_block": (lambda x: int8_block.int8_block_quantize(
          x, block_size=256), (S((N,), jnp.float16),)),
      "int8_block_stochastic": (lambda x, u: int8_block.int8_block_quantize(
          x, block_size=256, stochastic_uniform=u), (f32, f32)),
      # In-kernel dither from the seed, norms / scales in the kernel.
      "qsgd_seed_b128": (lambda x, s: qsgd.qsgd_quantize(
          x, levels=7, bucket_size=128, seed=s), (f32, seed)),
      "qsgd_seed_b256_tiled": (lambda x, s: qsgd.qsgd_quantize(
          x, levels=127, bucket_size=256, seed=s), (f32_tiled, seed)),
      "qsgd_seed_b512_16bit": (lambda x, s: qsgd.qsgd_quantize(
          x, levels=4000, bucket_size=512, seed=s), (f32, seed)),
      "qsgd_seed_b32_2bit": (lambda x, s: qsgd.qsgd_quantize(
          x, levels=1, bucket_size=32, seed=s), (f32, seed)),
      "qsgd_seed_b96_fallback": (lambda x, s: qsgd.qsgd_quantize(
          x, levels=7, bucket_size=96, seed=s), (f32, seed)),
      "int8_block_seed_b512_bf16": (lambda x, s: int8_block.int8_block_quantize(
          x, block_size=512, seed=s), (S((N,), jnp.bfloat16), seed)),
      "int8_block_seed_b128_tiled": (lambda x, s: int8_block.int8_block_quantize(
          x, block_size=128, seed=s), (f32_tiled, seed)),
      "topk_f32": (lambda x: topk.topk(x, 1000), (f32,)),
      "topk_f32_unpadded": (lambda x: topk.topk(x, 1000),
                            (S((N_TILED,), jnp.float32),)),
      "sign_pack_f32_unpadded": (lambda x: sign.sign_pack(x),
                                 (S((N_TILED,), jnp.float32),)),
      "topk_bf16_radix4": (lambda x: topk.topk(
          x, 10, config=topk.TopKConfig(block_rows=128, radix_bits=4)),
                           (S((N,), jnp.bfloat16),)),
      "sampled_topk": (lambda x: topk.sampled_topk(
          x, 1000, jax.random.key(0), sample_ratio=0.01,
          implementation="pallas"), (f32,)),
  }


@pytest.mark.parametrize("name", sorted(_cases()))
def test_exports_for_cuda_with_mosaic_gpu(name):
  fn, args = _cases()[name]
  exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
  text = exported.mlir_module()
  assert "stablehlo.custom_call @mosaic_gpu" in text, name
  assert exported.platforms == ("cuda",)


@pytest.mark.parametrize("op", ["sign_pack", "topk", "qsgd", "int8_block"])
def test_exports_inside_shard_map_with_check_vma(op):
  """Inside ``jax.shard_map`` (``check_vma=True`` by default) kernel outputs
  must be typed as varying over the mesh axis, and loop carries that kernel
  outputs replace must vary too; tracing the exported step checks both."""
  from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
  fns = {
      "sign_pack": lambda x: sign.sign_pack(x)[0],
      "topk": lambda x: topk.topk(x, 30)[1],
      "qsgd": lambda x: qsgd.qsgd_quantize(
          x, x, levels=7, bucket_size=512)[0],
      "int8_block": lambda x: int8_block.int8_block_quantize(
          x, block_size=256)[0],
  }
  mesh = AbstractMesh((8,), ("data",))
  f = jax.jit(jax.shard_map(lambda xs: fns[op](xs[0])[None], mesh=mesh,
                            in_specs=P("data"), out_specs=P("data")))
  arg = S((8, 3001), jnp.float32, sharding=NamedSharding(mesh, P("data")))
  exported = jax.export.export(f, platforms=["cuda"])(arg)
  assert "stablehlo.custom_call @mosaic_gpu" in exported.mlir_module()


# Imports jaxcomp and lowers every op's dispatch for CUDA with
# DeprecationWarning and FutureWarning made errors: the library must warn
# about nothing, on every JAX the CI runs (JAX 0.12 warns at each lowering of
# a Pallas Triton kernel, which the dispatch therefore does not take there).
NO_WARNINGS = """
import jax, jax.numpy as jnp
import jaxcomp
from jaxcomp.hlo import kernel_structure as structure
from jaxcomp.kernels import fp8_block, int8_block, qsgd, sign, topk
x = jax.ShapeDtypeStruct((4096,), jnp.float32)
seed = jnp.array([1, 2], jnp.uint32)
for impl in ("pallas", None):
  for f in (
      lambda v: int8_block.int8_block_quantize_auto(
          v, block_size=256, implementation=impl),
      lambda v: fp8_block.fp8_block_quantize_auto(
          v, block_size=256, seed=seed, implementation=impl),
      lambda v: sign.sign_pack_auto(v, implementation=impl),
      lambda v: qsgd.qsgd_quantize_auto(
          v, levels=15, bucket_size=512, seed=seed, implementation=impl),
      lambda v: topk.topk_auto(v, 40, implementation=impl),
      lambda v: topk.sampled_topk(v, 40, jax.random.key(0), sample_ratio=0.1,
                                  implementation=impl)):
    structure.export_cuda(f, x)
print("OK")
"""


def test_import_and_lowering_warn_nothing():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep
             + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
  res = subprocess.run(
      [sys.executable, "-W", "error::DeprecationWarning",
       "-W", "error::FutureWarning", "-c", NO_WARNINGS],
      env=env, capture_output=True, text=True, timeout=300, check=False)
  assert res.returncode == 0 and res.stdout.strip().endswith("OK"), (
      res.stdout + res.stderr)
