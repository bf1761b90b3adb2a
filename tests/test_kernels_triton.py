"""The Triton-lowered int8 / fp8 block kernels (jaxcomp.kernels._triton).

Interpret mode on any backend gives the references' codes and scales bit for
bit (every rounding, 16-bit inputs read in their own dtype, partial last
blocks, non-finite inputs); compiled on an NVIDIA GPU the same cases run in
:class:`TestTritonCompiled`. The CUDA export (where the installed JAX lowers
Triton without a GPU) holds one Triton custom call reading ``x`` as it is.
"""

import itertools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp.kernels import _launch
from jaxcomp.kernels import _triton
from jaxcomp.kernels import fp8_block
from jaxcomp.kernels import int8_block
from jaxcomp.kernels import qsgd
from jaxcomp.kernels import sign
from jaxcomp.hlo import kernel_structure as structure

ROUNDINGS = ("nearest", "array", "bits", "seed")


def _input(n, dtype, block):
  x = (jax.random.normal(jax.random.key(n), (n,)) * 5).astype(dtype)
  if n > 3 * block:  # a block of zeros, an infinity in each of the next two
    x = x.at[:block].set(0).at[block + 3].set(jnp.inf)
    x = x.at[2 * block + 1].set(-jnp.inf)
  return x


def _normal(n, dtype, seed=0):
  return jax.random.normal(jax.random.key(seed), (n,)).astype(dtype)


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


  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
  @pytest.mark.parametrize("n,rows", [(1, 128), (31, 128), (100_003, 128),
                                      (8192, 256), (4101, 1)])
  def test_sign_equals_the_reference(self, dtype, n, rows):
    """The words bit for bit (-0.0 and NaN give bit 0, -inf bit 1); the
    scale up to float32 summation order, non-finite where |x| is."""
    x = _normal(n, dtype, seed=n)
    w, scale = sign.sign_pack_triton(x, rows=rows, interpret=self.INTERPRET)
    want_w, want_scale = sign.sign_pack_reference(x)
    assert w.dtype == jnp.uint32 and w.shape == want_w.shape
    np.testing.assert_array_equal(np.asarray(w), np.asarray(want_w))
    np.testing.assert_allclose(float(scale), float(want_scale), rtol=1e-5)
    if n > 10:
      x = x.at[2].set(-0.0).at[3].set(jnp.nan).at[4].set(-jnp.inf)
      w, scale = sign.sign_pack_triton(x, rows=rows, interpret=self.INTERPRET)
      np.testing.assert_array_equal(np.asarray(w),
                                    np.asarray(sign.sign_pack_reference(x)[0]))
      assert (int(w[0]) >> 2) & 7 == 0b100 and np.isnan(float(scale))


  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
  @pytest.mark.parametrize("n,bucket,levels,rounding", [
      (100_003, 512, 15, "seed"), (5000, 32, 1, "array"),
      (4096, 256, 127, "bits"), (70, 64, 3, "seed"), (3000, 8192, 32767,
                                                      "array")])
  def test_qsgd_codes_are_the_reference_under_its_norms(
      self, dtype, n, bucket, levels, rounding):
    """Norms within 4 ulp of XLA's; the words exactly
    ``qsgd_codes_reference`` under the norms returned (2-, 4-, 8- and
    16-bit codes, partial last buckets and words)."""
    x = _normal(n, dtype, seed=n) * 3
    kw = ({"seed": jnp.array([3, 4], jnp.uint32)} if rounding == "seed"
          else _rounding(rounding, n))
    kw = {"uniform": kw.pop("stochastic_uniform"), **kw} if (
        "stochastic_uniform" in kw) else kw
    w, norms = qsgd.qsgd_quantize_triton(
        x, levels=levels, bucket_size=bucket, interpret=self.INTERPRET, **kw)
    want_w, want_norms = qsgd.qsgd_quantize_reference(
        x, levels=levels, bucket_size=bucket, **kw)
    assert w.shape == want_w.shape and norms.shape == want_norms.shape
    np.testing.assert_array_max_ulp(np.asarray(norms), np.asarray(want_norms),
                                    4)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(
        qsgd.qsgd_codes_reference(x, norms, kw.get("uniform"), levels=levels,
                                  bucket_size=bucket, seed=kw.get("seed"))))

  @pytest.mark.parametrize("value", [1e30, 1e-30, np.inf, np.nan])
  def test_qsgd_unsound_norms_take_the_reference(self, value):
    """A bucket whose sum of squares overflows or loses its squares to
    subnormals (the reference rescales it), or holds an infinity or NaN:
    the step returns the reference's words and norms bit for bit."""
    x = _normal(2000, jnp.float32, seed=1).at[700:705].set(value)
    if value == 1e-30:
      x = x.at[512:1024].set(x[512:1024] * 1e-30)
    seed = jnp.array([5, 6], jnp.uint32)
    got = qsgd.qsgd_quantize_triton(x, levels=15, bucket_size=512, seed=seed,
                                    interpret=self.INTERPRET)
    want = qsgd.qsgd_quantize_reference(x, levels=15, bucket_size=512,
                                        seed=seed)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


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


@pytest.mark.parametrize("kwargs,match", [
    ({"rows": 3}, "rows=3 must be a power of two"),
    ({"rows": 512}, "exceeds 8192 elements"),
    ({"num_warps": 3}, "num_warps=3"),
])
def test_sign_bad_launch_raises_naming_the_parameter(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sign.sign_pack_triton(jnp.ones(100), interpret=True, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"bucket_size": 96}, "block_size=96 must be a power of two"),
    ({"bucket_size": 512, "rows": 3}, "rows=3 must be a power of two"),
    ({"bucket_size": 512, "num_warps": 3}, "num_warps=3"),
    ({"bucket_size": 512, "levels": 0}, "levels=0"),
    ({"bucket_size": 512, "seed": None}, "uniform= or seed="),
    ({"bucket_size": 512, "uniform": jnp.zeros(100)}, "not both"),
    ({"bucket_size": 512, "seed": jnp.zeros(3, jnp.uint32)}, "seed must be"),
])
def test_qsgd_bad_arguments_raise_before_tracing(kwargs, match):
  kwargs = {"levels": 15, "seed": jnp.zeros(2, jnp.uint32), **kwargs}
  with pytest.raises(ValueError, match=match):
    qsgd.qsgd_quantize_triton(jnp.ones(100), interpret=True, **kwargs)


def test_sign_empty_input():
  w, scale = sign.sign_pack_triton(jnp.zeros((0,)))
  assert w.shape == (0,) and np.isnan(float(scale))


def test_pallas_path_takes_triton_for_powers_of_two(monkeypatch):
  monkeypatch.setattr(_triton, "available", lambda: True)
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
  # Where the dispatch takes no Triton kernel: XLA for the powers of two.
  monkeypatch.setattr(_triton, "available", lambda: False)
  calls.clear()
  for block in (256, 96):
    got = int8_block.int8_block_quantize_pallas(x, block_size=block)
    if block == 256:
      want = int8_block.int8_block_quantize_reference(x, block_size=256)
      for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    fp8_block.fp8_block_quantize_pallas(x, block_size=block)
  assert calls == [("mosaic", 96)] * 2


# Run with Pallas' Triton backend made unimportable (as in a JAX that has
# removed it): jaxcomp imports, the dispatch takes XLA where it took Triton
# (payload and CUDA export), and the Triton kernels asked for by name raise
# ImportError.
WITHOUT_TRITON = """
import sys
sys.modules["jax.experimental.pallas.triton"] = None  # import raises
import jax, jax.numpy as jnp, numpy as np
import jaxcomp
from jaxcomp import _jaxcompat
from jaxcomp.hlo import kernel_structure as structure
from jaxcomp.kernels import _triton, int8_block, fp8_block, sign, topk
assert not _jaxcompat.pallas_triton_present() and not _triton.available()
x = jnp.linspace(-3.0, 3.0, 4096, dtype=jnp.float32)
auto = lambda v: int8_block.int8_block_quantize_auto(
    v, block_size=256, implementation="pallas")
for a, b in zip(auto(x), int8_block.int8_block_quantize_reference(
    x, block_size=256)):
  np.testing.assert_array_equal(a, b)
text = structure.export_cuda(auto, x).mlir_module()
assert "custom_call" not in text, text
fp8 = lambda v: fp8_block.fp8_block_quantize_auto(
    v, block_size=256, implementation="pallas")
assert "custom_call" not in structure.export_cuda(fp8, x).mlir_module()
for f in (lambda: int8_block.int8_block_quantize_triton(
              x, block_size=256, interpret=True),
          lambda: sign.sign_pack_triton(x, interpret=True),
          lambda: topk.topk_triton(x, 40, interpret=True)):
  try:
    f()
  except ImportError as e:
    assert "jax.experimental.pallas.triton" in str(e), e
  else:
    raise AssertionError("built a Triton kernel without the backend")
print("OK")
"""


def test_without_the_triton_backend_the_dispatch_takes_xla():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep
             + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], env=env,
                       capture_output=True, text=True, timeout=120,
                       check=False)
  assert res.returncode == 0 and res.stdout.strip().endswith("OK"), (
      res.stdout + res.stderr)


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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_qsgd_cuda_export_reads_x_once_outside_the_unsound_branch(dtype):
  """One Triton call reads x as it is; XLA reads x only in the branch of
  steps with an unsound norm (the reference)."""
  n = 100_003
  s = structure.export_structure(
      lambda v: qsgd.qsgd_quantize_triton(
          v, levels=15, bucket_size=512, seed=jnp.array([1, 2], jnp.uint32)),
      jax.ShapeDtypeStruct((n,), dtype))
  info = s.summary()
  assert s.kernels == 1 and s.kernel_reads_of_x == 1, info
  assert s.before == [] and s.random == [], info


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sign_cuda_export_reads_x_once_in_its_dtype(dtype):
  """One Triton call takes x as it is; XLA only adds the programs' sums."""
  n = 100_003
  text = structure.export_cuda(sign.sign_pack_triton,
                               jax.ShapeDtypeStruct((n,), dtype)).mlir_module()
  calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)", text)
  assert calls == [structure.TRITON_TARGET], calls
  for op in ("stablehlo.pad", "stablehlo.convert", "stablehlo.slice"):
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
