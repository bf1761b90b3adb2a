"""The Triton-lowered selection (jaxcomp.kernels._topk_triton) and the
top-k built on it (topk.topk_triton).

In interpret mode on any backend, and compiled on an NVIDIA GPU
(:class:`TestTritonSelectCompiled`): the selection equals NumPy's
``flatnonzero(key >= t)`` cut to the capacity (every dtype, partial last
program, padding never selected, NaN and infinities ranked as the key
orders them), and top-k equals ``topk_exact_small`` (lax.top_k's set in
ascending index order) on every branch of the sampled selection. The CUDA
export holds two Triton calls reading ``x`` as it is, and XLA reads only
the sample.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp.hlo import kernel_structure as structure
from jaxcomp.kernels import _launch
from jaxcomp.kernels import _topk_select
from jaxcomp.kernels import _topk_triton
from jaxcomp.kernels import topk
from tests.test_kernels import BRANCHES, TCFG, _branch_case


def _keys(x):
  return np.asarray(topk.abs_key(jnp.asarray(x)))


class TestTritonSelectCompiled:
  """Compiled by Triton: skipped off an NVIDIA GPU (interpret mode below)."""

  INTERPRET = False

  def setup_method(self):
    if not self.INTERPRET and not _launch.nvidia_gpu():
      pytest.skip("the Triton kernels compile only on an NVIDIA GPU backend")

  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
  @pytest.mark.parametrize("n,span", [(3000, 256), (37, 32), (4096, 1024)])
  @pytest.mark.parametrize("capacity", [1, 40, 5000])
  def test_select_at_least_is_flatnonzero_cut_to_capacity(
      self, dtype, n, span, capacity):
    rng = np.random.default_rng(n + capacity)
    x = jnp.asarray(rng.standard_normal(n) * 2, dtype)
    if n > 10:
      x = x.at[3].set(jnp.nan).at[5].set(-jnp.inf).at[8].set(-0.0)
    t = topk.abs_key(jnp.asarray(1.0, jnp.float32))
    idx, key, count = _topk_triton.select_at_least(
        x, t, capacity=capacity, span=span, interpret=self.INTERPRET)
    keys = _keys(x)
    want = np.flatnonzero(keys >= int(t))
    assert idx.shape == key.shape == (capacity,)
    assert idx.dtype == key.dtype == count.dtype == jnp.int32
    assert int(count) == want.size
    m = min(capacity, want.size)
    np.testing.assert_array_equal(np.asarray(idx)[:m], want[:m])
    np.testing.assert_array_equal(np.asarray(key)[:m], keys[want[:m]])
    assert (np.asarray(idx)[m:] == 0).all() and (np.asarray(key)[m:] == -1).all()
    if n > 10:
      assert {3, 5} <= set(want.tolist()) and 8 not in want  # NaN, -inf, -0


  def test_threshold_zero_selects_every_element_but_no_padding(self):
    """Key 0 passes every element (zeros included); the reads past ``n`` in
    the last program load 0 and must not count."""
    x = jnp.zeros(100)
    idx, _, count = _topk_triton.select_at_least(
        x, jnp.int32(0), capacity=128, span=64, interpret=self.INTERPRET)
    assert int(count) == 100
    np.testing.assert_array_equal(np.asarray(idx)[:100], np.arange(100))
    counts = _topk_triton.count_at_least(x, jnp.int32(0), span=64,
                                         interpret=self.INTERPRET)
    np.testing.assert_array_equal(counts, [64, 36])


  @pytest.mark.parametrize("case", BRANCHES + ["nonfinite", "plus_minus_ties"])
  def test_topk_triton_every_branch(self, case):
    """The same values and indices as lax.top_k's set in ascending index
    order, on every branch of the sampled selection: the candidates (the
    Triton compaction), ties at the sample threshold and a misleading sample
    (the XLA path's branch), dense and whole selections."""
    x, k = _branch_case(case)
    want_v, want_i = topk.topk_exact_small(x, k)
    for band_only in (False, True):
      v, i = topk.topk_triton(x, k, config=TCFG, span=512,
                              band_only=band_only, interpret=self.INTERPRET)
      assert v.dtype == x.dtype and i.dtype == jnp.int32 and i.shape == (k,)
      np.testing.assert_array_equal(i, want_i, err_msg=str(band_only))
      np.testing.assert_array_equal(v, want_v, err_msg=str(band_only))


  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
  def test_topk_triton_candidates_branch_is_the_one_taken(self, dtype):
    """On a normal gradient the sample's threshold passes between k and the
    capacity (so the Triton compaction's candidates give the result, not the
    XLA fallback), and the result is exact."""
    n, k = 50_000, 500
    x = jnp.asarray(np.random.default_rng(5).standard_normal(n), dtype)
    s, rank, _, cap, _ = _topk_select.sample_plan(n, k, TCFG)
    top = _topk_select.sample_top_keys(x[: s * (n // s) : n // s], rank,
                                       topk.selection(TCFG))
    count = _topk_triton.count_at_least(x, top[rank - 1], span=1024,
                                        interpret=self.INTERPRET).sum()
    assert k <= int(count) <= cap, (int(count), k, cap)
    want_v, want_i = topk.topk_exact_small(x, k)
    v, i = topk.topk_triton(x, k, config=TCFG, span=1024, interpret=self.INTERPRET)
    np.testing.assert_array_equal(i, want_i)
    np.testing.assert_array_equal(v, want_v)


  @pytest.mark.parametrize("n,k", [(50_000, 500), (3001, 30), (1000, 1000)])
  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
  def test_sampled_topk_triton_is_dgcs(self, n, k, dtype):
    """DGC's sampled top-k: the same values and indices as the XLA path's
    (the same sample and threshold; the first k at or above it in index
    order, missing slots index 0 and value 0), including a threshold that
    passes fewer than k (a mostly-zero gradient)."""
    rng = np.random.default_rng(n)
    for x in (rng.standard_normal(n),
              np.where(rng.random(n) < 0.002, rng.standard_normal(n), 0.0)):
      x = jnp.asarray(x, dtype)
      key = jax.random.key(3)
      want = topk.sampled_topk(x, k, key, sample_ratio=0.05,
                               implementation="xla")
      got = topk.sampled_topk_triton(x, k, key, sample_ratio=0.05, span=1024,
                                     interpret=self.INTERPRET)
      np.testing.assert_array_equal(got[1], want[1])
      np.testing.assert_array_equal(got[0], want[0])


class TestTritonSelectInterpret(TestTritonSelectCompiled):
  """The same cases in Pallas' interpret mode, on any backend."""

  INTERPRET = True


@pytest.mark.parametrize("kwargs,match", [
    (dict(span=100), "span=100 must be a power of two"),
    (dict(span=16384), "span=16384"),
    (dict(num_warps=3), "num_warps=3"),
])
def test_bad_launch_raises_naming_the_parameter(kwargs, match):
  with pytest.raises(ValueError, match=match):
    topk.topk_triton(jnp.ones(100), 5, interpret=True, **kwargs)
  with pytest.raises(ValueError, match=match):
    _topk_triton.select_at_least(jnp.ones(100), jnp.int32(0), capacity=8,
                                 interpret=True, **kwargs)
  with pytest.raises(ValueError, match=match):
    topk.sampled_topk_triton(jnp.ones(100), 5, jax.random.key(0),
                             sample_ratio=0.5, interpret=True, **kwargs)


def test_zero_capacity_raises():
  with pytest.raises(ValueError, match="capacity=0"):
    _topk_triton.select_at_least(jnp.ones(100), jnp.int32(0), capacity=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cuda_export_two_triton_calls_read_x_and_xla_only_the_sample(dtype):
  """Outside the misled-sample branch: the count and compact kernels read
  ``x`` as it is (no converted or padded copy), XLA reads only the evenly
  spaced sample (one strided slice)."""
  n = 2_500_003
  arg = jax.ShapeDtypeStruct((n,), dtype)
  s = structure.export_structure(lambda v: topk.topk_triton(v, n // 100), arg)
  info = s.summary()
  assert s.kernels == 2 and s.kernel_reads_of_x == 2, info
  assert s.x_reads == ["stablehlo.slice"], info
  text = structure.export_cuda(lambda v: topk.topk_triton(v, n // 100),
                               arg).mlir_module()
  calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)", text)
  assert calls == [structure.TRITON_TARGET] * 2, calls


def test_cuda_export_inside_shard_map():
  """Inside shard_map (check_vma) the kernels' outputs are typed as varying
  like x, so the branches agree."""
  from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
  mesh = AbstractMesh((8,), ("data",), abstract_device=structure.EXPORT_GPU)
  f = jax.shard_map(lambda xs: topk.topk_triton(xs[0], 3000)[1][None],
                    mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  arg = jax.ShapeDtypeStruct((8, 300_000), jnp.float32,
                             sharding=NamedSharding(mesh, P("data")))
  with jax.sharding.use_abstract_mesh(mesh):
    text = structure.export_cuda(f, arg).mlir_module()
  assert text.count(f"stablehlo.custom_call @{structure.TRITON_TARGET}") == 2


def test_sampled_topk_triton_cuda_export_is_two_triton_calls():
  text = structure.export_cuda(
      lambda v, key: topk.sampled_topk_triton(v, 25_000, key,
                                              sample_ratio=0.01),
      jax.ShapeDtypeStruct((2_500_000,), jnp.float32),
      jax.random.key(0)).mlir_module()
  calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)", text)
  assert calls == [structure.TRITON_TARGET] * 2, calls
