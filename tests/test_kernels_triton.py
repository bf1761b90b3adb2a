"""The Triton-lowered int8 / fp8 block kernels (jaxcomp.kernels._triton).

Interpret mode on any backend gives the references' codes and scales bit for
bit (every rounding, 16-bit inputs read in their own dtype, partial last
blocks, non-finite inputs); compiled on an NVIDIA GPU the same cases run in
:class:`TestTritonCompiled`. The CUDA export (where the installed JAX lowers
Triton without a GPU) holds one Triton custom call reading ``x`` as it is.
"""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp.kernels import _launch
from jaxcomp.kernels import fp8_block
from jaxcomp.kernels import int8_block
from jaxcomp.inspect import kernel_structure as structure

ROUNDINGS = ("nearest", "array", "bits", "seed")


def _input(n, dtype, block):
  x = (jax.random.normal(jax.random.key(n), (n,)) * 5).astype(dtype)
  if n > 3 * block:  # a block of zeros, an infinity in each of the next two
    x = x.at[:block].set(0).at[block + 3].set(jnp.inf)
    x = x.at[2 * block + 1].set(-jnp.inf)
  return x


def _rounding(rounding, n):
  if rounding == "array":
    return {"stochastic_uniform": jax.random.uniform(jax.random.key(2), (n,))}
  if rounding == "bits":
    return {"stochastic_uniform": jax.random.bits(jax.random.key(3), (n,),
                                                  jnp.uint32)}
  if rounding == "seed":
    return {"seed": jnp.array([7, 11], jnp.uint32)}
  return {}


def _bytes(a):
  a = np.asarray(a)
  return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _check(got, want, single_block=False):
  (q, s), (q_ref, s_ref) = got, want
  assert q.shape == q_ref.shape and q.dtype == q_ref.dtype
  assert s.shape == s_ref.shape and s.dtype == s_ref.dtype
  np.testing.assert_array_equal(_bytes(q), _bytes(q_ref))
  if single_block:
    # XLA:CPU divides a lone block's maximum by F through a reciprocal in
    # one of the two programs (1 ulp apart; the codes agree): a CPU quirk of
    # the interpreter, not of the kernel, whose scales equal the reference's
    # on the GPU (benchmarks/results/nvidia-h200-2026-11-28).
    np.testing.assert_array_max_ulp(np.asarray(s), np.asarray(s_ref), 1)
  else:
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))


CASES = [(n, dtype, block, rounding)
         for (n, block), dtype, rounding in itertools.product(
             ((1000, 256), (8455, 256), (6144, 1024), (3001, 32)),
             (jnp.float32, jnp.bfloat16, jnp.float16), ROUNDINGS)
         if not (dtype == jnp.float16 and rounding in ("array", "bits"))]


class TestTritonCompiled:
  """Compiled by Triton: skipped off an NVIDIA GPU."""

  INTERPRET = False

  def setup_method(self):
    if not self.INTERPRET and not _launch.nvidia_gpu():
      pytest.skip("the Triton kernels compile only on an NVIDIA GPU backend")

  @pytest.mark.parametrize("n,dtype,block,rounding", CASES)
  def test_int8_equals_the_reference(self, n, dtype, block, rounding):
    x, kw = _input(n, dtype, block), _rounding(rounding, n)
    _check(int8_block.int8_block_quantize_triton(
        x, block_size=block, interpret=self.INTERPRET, **kw),
           int8_block.int8_block_quantize_reference(x, block_size=block, **kw))

  @pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
  @pytest.mark.parametrize("n,dtype,block,rounding", CASES[::3])
  def test_fp8_equals_the_reference(self, n, dtype, block, rounding, fmt):
    x, kw = _input(n, dtype, block), _rounding(rounding, n)
    _check(fp8_block.fp8_block_quantize_triton(
        x, block_size=block, format=fmt, interpret=self.INTERPRET, **kw),
           fp8_block.fp8_block_quantize_reference(x, block_size=block,
                                                  format=fmt, **kw))

  @pytest.mark.parametrize("n", [1, 31, 256])
  def test_one_block(self, n):
    x = _input(n, jnp.float32, 256)
    _check(int8_block.int8_block_quantize_triton(
        x, block_size=256, interpret=self.INTERPRET),
           int8_block.int8_block_quantize_reference(x, block_size=256),
           single_block=True)
    _check(fp8_block.fp8_block_quantize_triton(
        x, block_size=256, interpret=self.INTERPRET),
           fp8_block.fp8_block_quantize_reference(x, block_size=256),
           single_block=True)

  def test_round_half_to_even(self):
    # Block maximum 127 makes the multiplier 1: y = x exactly.
    x = jnp.array([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 3.5]
                  + [0.0] * 23, jnp.float32)
    q, _ = int8_block.int8_block_quantize_triton(x, block_size=32,
                                                 interpret=self.INTERPRET)
    np.testing.assert_array_equal(np.asarray(q[:9]),
                                  [127, 0, 2, 2, 0, -2, -2, 0, 4])

  @pytest.mark.parametrize("rows,warps", [(1, 1), (4, 8), (32, 4)])
  def test_launch_shapes_give_the_same_bits(self, rows, warps):
    x = _input(8455, jnp.float32, 256)
    _check(int8_block.int8_block_quantize_triton(
        x, block_size=256, rows=rows, num_warps=warps,
        interpret=self.INTERPRET),
           int8_block.int8_block_quantize_reference(x, block_size=256))


class TestTritonInterpret(TestTritonCompiled):
  """The same cases in Pallas' interpret mode, on any backend."""

  INTERPRET = True


def test_empty_input():
  q, s = int8_block.int8_block_quantize_triton(jnp.zeros((0,)), block_size=32)
  assert q.shape == (0,) and s.shape == (0,)


@pytest.mark.parametrize("kwargs,match", [
    ({"block_size": 96}, "block_size=96 must be a power of two"),
    ({"block_size": 16}, "block_size=16 must be a power of two"),
    ({"block_size": 256, "rows": 3}, "rows=3 must be a power of two"),
    ({"block_size": 2048, "rows": 8}, "exceeds 8192 elements"),
    ({"block_size": 256, "num_warps": 3}, "num_warps=3"),
    ({"block_size": 256, "seed": jnp.zeros(2, jnp.uint32),
      "stochastic_uniform": jnp.zeros(100)}, "not both"),
    ({"block_size": 256, "seed": jnp.zeros(3, jnp.uint32)}, "seed must be"),
])
def test_bad_arguments_raise_before_tracing(kwargs, match):
  with pytest.raises(ValueError, match=match):
    int8_block.int8_block_quantize_triton(jnp.ones(100), interpret=True,
                                          **kwargs)


def test_pallas_path_takes_triton_for_powers_of_two(monkeypatch):
  calls = []
  monkeypatch.setattr(int8_block, "int8_block_quantize_triton",
                      lambda x, **kw: calls.append(("triton", kw["block_size"])))
  monkeypatch.setattr(int8_block, "int8_block_quantize",
                      lambda x, **kw: calls.append(("mosaic", kw["block_size"])))
  monkeypatch.setattr(fp8_block, "fp8_block_quantize_triton",
                      lambda x, **kw: calls.append(("triton", kw["block_size"])))
  monkeypatch.setattr(fp8_block, "fp8_block_quantize",
                      lambda x, **kw: calls.append(("mosaic", kw["block_size"])))
  x = jnp.ones(512)
  for block in (256, 96):
    int8_block.int8_block_quantize_pallas(x, block_size=block)
    fp8_block.fp8_block_quantize_pallas(x, block_size=block)
  assert calls == [("triton", 256)] * 2 + [("mosaic", 96)] * 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cuda_export_reads_x_once_in_its_dtype(dtype):
  n = 100_003  # not a multiple of the block: no padded copy all the same
  x = jax.ShapeDtypeStruct((n,), dtype)
  text = structure.export_cuda(lambda v: int8_block.int8_block_quantize_triton(
      v, block_size=256), x).mlir_module()
  calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)", text)
  assert calls == [structure.TRITON_TARGET], calls
  for op in ("stablehlo.pad", "stablehlo.concatenate", "stablehlo.convert",
             "stablehlo.slice", "stablehlo.reduce"):
    assert op not in text, op
  name = {jnp.float32: "f32", jnp.bfloat16: "bf16"}[dtype]
  assert re.search(rf"custom_call @[\w$.]+\(%arg0\).*tensor<{n}x{name}>",
                   text), "x reaches the kernel as it is"


def test_cuda_export_inside_shard_map():
  """Inside shard_map (check_vma) the outputs are typed as varying like x."""
  from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
  mesh = AbstractMesh((8,), ("data",), abstract_device=structure.EXPORT_GPU)
  f = jax.shard_map(lambda xs: fp8_block.fp8_block_quantize_triton(
      xs[0], block_size=256, seed=jnp.array([1, 2], jnp.uint32))[0][None],
                    mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  arg = jax.ShapeDtypeStruct((8, 3001), jnp.float32,
                             sharding=NamedSharding(mesh, P("data")))
  with jax.sharding.use_abstract_mesh(mesh):
    text = structure.export_cuda(f, arg).mlir_module()
  assert f"stablehlo.custom_call @{structure.TRITON_TARGET}" in text
