"""Bucket plans: fixed element and byte sizes, exact small leaves, layer-wise
versus whole-model top-k, and the MG-WFBP merge plan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp import bucketing
from jaxcomp.perfmodel import wfbp_finish_time
from tests.helpers import run_shard_map

P_DEV = 8


@pytest.mark.parametrize("limit", [1, 100, 1200, 5000, 10**6])
def test_fixed_bytes_buckets(limit):
  sizes = [10, 300, 5, 1000, 20, 7, 450]
  plan = bucketing.plan_buckets(sizes, strategy="fixed_bytes",
                                bucket_bytes=limit, min_size=6)
  assert plan.exact == (2,)  # the only leaf below 6 elements
  flat = [i for b in plan.buckets for i in b]
  assert flat == [i for i in range(len(sizes)) if i != 2]  # order kept
  nbytes = [4 * sum(sizes[i] for i in b) for b in plan.buckets]
  for b, nb in zip(plan.buckets[:-1], nbytes[:-1]):
    assert nb >= limit  # closed once full ...
    assert nb - 4 * sizes[b[-1]] < limit  # ... and not a leaf later
  same = bucketing.plan_buckets(sizes, strategy="fixed", min_size=6,
                                bucket_elements=-(-limit // 4))
  assert same == plan


def _topk_rows(x, k):
  out = np.zeros_like(x)
  for d in range(x.shape[0]):
    idx = np.argsort(-np.abs(x[d]), kind="stable")[:k]
    out[d, idx] = x[d, idx]
  return out


@pytest.fixture(scope="module")
def two_scale_grads():
  k1, k2 = jax.random.split(jax.random.key(0))
  # Leaf "a" is 10x larger in magnitude than leaf "b".
  return {"a": 10 * jax.random.normal(k1, (P_DEV, 40)),
          "b": jax.random.normal(k2, (P_DEV, 60))}


def test_layerwise_and_whole_topk_differ_and_are_each_correct(
    mesh8, two_scale_grads):
  g = two_scale_grads
  ga, gb = np.asarray(g["a"]), np.asarray(g["b"])
  out = {}
  for strategy in ("layerwise", "whole"):
    tx = jaxcomp.compressed_mean("topk", "data", ratio=0.1,
                                 error_feedback=False, bucketing=strategy)
    u, _, _, _ = run_shard_map(tx, g, mesh8)
    out[strategy] = (np.asarray(u["a"]), np.asarray(u["b"]))
  # Layer-wise: top-4 of a and top-6 of b on every device.
  np.testing.assert_allclose(out["layerwise"][0], _topk_rows(ga, 4).mean(0),
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(out["layerwise"][1], _topk_rows(gb, 6).mean(0),
                             rtol=1e-6, atol=1e-6)
  # Whole model: top-10 of the concatenation, mostly from the larger leaf.
  whole = _topk_rows(np.concatenate([ga, gb], axis=1), 10).mean(0)
  np.testing.assert_allclose(np.concatenate(out["whole"]), whole, rtol=1e-6,
                             atol=1e-6)
  assert np.count_nonzero(out["whole"][1]) < np.count_nonzero(
      out["layerwise"][1])
  assert not np.allclose(out["whole"][0], out["layerwise"][0])


def test_small_leaves_go_through_exact_pmean(mesh8, two_scale_grads):
  g = dict(two_scale_grads, bias=jax.random.normal(jax.random.key(1), (P_DEV, 5)))
  tx = jaxcomp.compressed_mean("topk", "data", ratio=0.1, min_compress_size=6,
                               bucketing="layerwise")
  u, ref, state, _ = run_shard_map(tx, g, mesh8)
  np.testing.assert_array_equal(np.asarray(u["bias"]), np.asarray(ref["bias"]))
  assert not np.allclose(np.asarray(u["b"]), np.asarray(ref["b"]))
  assert len(state.feedback) == 2  # bias has no bucket and no residual
  stats = jaxcomp.get_stats(state)
  comp = jaxcomp.compressors.get("topk", ratio=0.1)
  assert int(stats.bytes_sent) == (comp.payload_bytes(40)
                                   + comp.payload_bytes(60) + 4 * 5)


def paper_style_model():
  """20 blocks of a weight (64k to 192k elements) and a 256-element bias:
  many small layers. Backward time 4 ns per weight element, 5 us per bias;
  alpha and beta measured by Shi et al. on 56 Gb InfiniBand."""
  params, times = [], []
  for b in range(20):
    w = 65536 * (1 + b % 3)
    params += [jax.ShapeDtypeStruct((w,), jnp.float32),
               jax.ShapeDtypeStruct((256,), jnp.float32)]
    times += [w * 4e-9, 5e-6]
  return params, times, 0.24e-3, 0.41e-9


def test_mgwfbp_beats_per_layer_and_single_bucket():
  params, times, alpha, beta = paper_style_model()
  plan = bucketing.mgwfbp_plan_for(params, times, alpha, beta)
  n = len(params)
  # Buckets of consecutive layers, output layer first, each leaf once.
  assert [i for b in plan for i in reversed(b)] == list(reversed(range(n)))
  layer_bytes = [4 * p.shape[0] for p in params]

  def t(buckets):
    return wfbp_finish_time(buckets, layer_bytes, times, alpha, beta)

  per_layer = t([[i] for i in reversed(range(n))])
  single = t([list(range(n))])
  merged = t(plan)
  assert 1 < len(plan) < n
  assert merged < 0.9 * per_layer
  assert merged < 0.9 * single


def test_mgwfbp_plan_runs_in_compressed_mean(mesh8):
  shapes = [(30,), (4,), (50,), (6,), (20,)]
  g = {f"l{i}": jax.random.normal(jax.random.key(i), (P_DEV, *s))
       for i, s in enumerate(shapes)}
  params = {k: jnp.zeros(v.shape[1:]) for k, v in g.items()}
  plan = bucketing.mgwfbp_plan_for(params, [1e-4] * 5, alpha=1e-3,
                                   beta=1e-9, min_size=7)
  assert sorted(i for b in plan for i in b) == [0, 2, 4]  # 4 and 6 skipped
  tx = jaxcomp.compressed_mean("identity", "data", bucketing="mgwfbp",
                               plan=plan)
  u, ref, state, _ = run_shard_map(tx, g, mesh8)
  for k in g:
    np.testing.assert_allclose(np.asarray(u[k]), np.asarray(ref[k]),
                               rtol=1e-6, atol=1e-6)
  assert len(state.exchange_state) == len(plan)


def test_mgwfbp_plan_follows_forward_order():
  params = [jnp.zeros(10)] * 4
  order = [2, 0, 3, 1]  # leaf 2 is the input layer, leaf 1 the output layer
  plan = bucketing.mgwfbp_plan_for(params, [1e-3] * 4, alpha=0.0, beta=1e-9,
                                   order=order)
  # No start-up cost and each message done before the next gradient exists:
  # nothing to merge; buckets follow the backward order.
  assert plan == [[1], [3], [0], [2]]
  merged = bucketing.mgwfbp_plan_for(params, [1e-3] * 4, alpha=1.0, beta=0.0,
                                     order=order)
  assert merged == [[2, 0, 3, 1]]


class TestBadInput:

  def test_mgwfbp_needs_plan(self):
    with pytest.raises(ValueError, match="mgwfbp_plan_for"):
      jaxcomp.compressed_mean("topk", "data", bucketing="mgwfbp")

  def test_fixed_bytes_needs_size(self):
    with pytest.raises(ValueError, match="bucket_bytes"):
      jaxcomp.compressed_mean("topk", "data", bucketing="fixed_bytes")
    with pytest.raises(ValueError, match="bucket_bytes"):
      jaxcomp.compressed_mean("topk", "data", bucketing="fixed_bytes",
                              bucket_bytes=0)

  def test_fixed_needs_size(self):
    with pytest.raises(ValueError, match="bucket_elements"):
      jaxcomp.compressed_mean("topk", "data", bucketing="fixed")

  def test_unknown_strategy(self):
    with pytest.raises(ValueError, match="bucketing must be one of"):
      jaxcomp.compressed_mean("topk", "data", bucketing="global")

  def test_bad_plans(self):
    with pytest.raises(ValueError, match="twice or out of range"):
      bucketing.plan_buckets([3, 3], plan=[[0], [0, 1]])
    with pytest.raises(ValueError, match="twice or out of range"):
      bucketing.plan_buckets([3, 3], plan=[[2]])
    with pytest.raises(ValueError, match="leaf indices"):
      jaxcomp.compressed_mean("topk", "data", plan=[[0, -1]])

  def test_mgwfbp_inputs(self):
    params = [jnp.zeros(3)] * 3
    with pytest.raises(ValueError, match="one value per parameter leaf"):
      bucketing.mgwfbp_plan_for(params, [1e-3] * 2, 1e-3, 1e-9)
    with pytest.raises(ValueError, match=">= 0"):
      bucketing.mgwfbp_plan_for(params, [1e-3, -1.0, 1e-3], 1e-3, 1e-9)
    with pytest.raises(ValueError, match="permutation"):
      bucketing.mgwfbp_plan_for(params, [1e-3] * 3, 1e-3, 1e-9, order=[0, 0, 1])
    with pytest.raises(ValueError, match="no leaf"):
      bucketing.mgwfbp_plan_for(params, [1e-3] * 3, 1e-3, 1e-9, min_size=10)


def test_auto_packs_small_leaves_and_keeps_large_ones_alone(mesh8):
  """The default bucketing: a leaf of at least bucket_bytes is a bucket
  alone (top-k of that leaf), consecutive smaller ones of one dtype share a
  bucket (top-k over them together), a bf16 leaf is not packed with float32
  ones; chunked top-k, bound to a tensor's shape, stays one bucket per
  leaf."""
  k = jax.random.split(jax.random.key(3), 4)
  g = {"a": jax.random.normal(k[0], (P_DEV, 3)),        # small
       "b": jax.random.normal(k[1], (P_DEV, 4)) * 10,   # small, large values
       "c": jax.random.normal(k[2], (P_DEV, 40)),       # 160 bytes: alone
       "d": jax.random.normal(k[3], (P_DEV, 5)).astype(jnp.bfloat16)}
  tx = jaxcomp.compressed_mean("topk", "data", ratio=0.25, bucket_bytes=100)
  u, _, state, _ = run_shard_map(tx, g, mesh8)
  assert set(state.config.plan.buckets) == {(0, 1), (2,), (3,)}  # (a b) (c) (d)
  assert sorted(len(f) for f in state.feedback) == [1, 1, 2]
  assert jaxcomp.transform_configs(state)[""]["bucketing"] == "auto"
  ga, gb = np.asarray(g["a"]), np.asarray(g["b"])
  # a and b together: the top-2 of their 7 values on each device, which the
  # large values of b take.
  both = _topk_rows(np.concatenate([ga, gb], axis=1), 2).mean(0)
  np.testing.assert_allclose(np.concatenate([u["a"], u["b"]]), both,
                             rtol=1e-6, atol=1e-6)
  assert not np.any(np.asarray(u["a"]))
  np.testing.assert_allclose(u["c"], _topk_rows(np.asarray(g["c"]), 10).mean(0),
                             rtol=1e-6, atol=1e-6)
  assert u["d"].dtype == jnp.bfloat16
  chunked = jaxcomp.compressed_mean("chunked_topk", "data", topk=2, chunk=4)
  _, _, st, _ = run_shard_map(chunked, {"w": jnp.ones((P_DEV, 4, 4)),
                                        "v": jnp.ones((P_DEV, 4, 4))}, mesh8)
  assert jaxcomp.transform_configs(st)[""]["bucketing"] == "layerwise"
  assert [len(f) for f in st.feedback] == [1, 1]
  with pytest.raises(ValueError, match="drop bucket_bytes"):
    jaxcomp.compressed_mean("chunked_topk", "data", bucket_bytes=100)


def test_auto_leaves_plain_psums_to_xla():
  """identity and a cast over psum keep one bucket per leaf under "auto"
  (XLA's combiner merges their all-reduces; packing would add a copy)."""
  for name in ("identity", "bf16"):
    tx = jaxcomp.compressed_mean(name, "data")
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    st, _ = jaxcomp.placement.init_sharded(tx, {"a": jnp.zeros(3), "b": jnp.zeros(4)},
                                 mesh, "data")
    assert jaxcomp.transform_configs(st)[""]["bucketing"] == "layerwise", name
    assert len(st.exchange_state) == 2, name
