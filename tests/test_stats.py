"""Statistics users can trust ([integration] item 7): operand and wire
bytes, each against the dense all-reduce, read back from the compiled
step; every compressed_mean of a state counted."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from tests.helpers import sharded_update, stacked

N = 100_000


def _step_traffic(tx, mesh, params):
  f, state, _ = sharded_update(tx, params, mesh)
  g = stacked(jax.tree.map(lambda p: jnp.ones((8, *p.shape)), params), mesh)
  traffic = jaxcomp.collective_traffic(f.lower(g, state).compile())
  return jaxcomp.get_stats(state), traffic


@pytest.mark.parametrize("kwargs,wire_factor", [
    ({"ratio": 0.01}, 12.5),  # 7/4 n dense against 7 * 8k top-k, k = n/100
    ({"ratio": 0.01, "max_ratio": 0.1}, 1.25),  # a schedule sends capacity
])
def test_topk_wire_bytes_on_8_devices(mesh8, kwargs, wire_factor):
  stats, traffic = _step_traffic(
      jaxcomp.compressed_mean("topk", "data", **kwargs), mesh8,
      {"w": jnp.zeros((N,))})
  # Operand bytes count as before: 8 k bytes against 4 n.
  k = int(np.ceil(kwargs.get("max_ratio", kwargs["ratio"]) * N))
  assert float(stats.bytes_sent) == 8 * k
  assert float(stats.compression_factor) == pytest.approx(4 * N / (8 * k))
  # The wire: what the ring algorithms move for the step's collectives
  # (the compiled step's, less the non-finite flag's scalar all-reduce).
  flag = jaxcomp.wire.ring_bytes("all-reduce", 4, 8)
  assert float(stats.wire_bytes) == pytest.approx(traffic.ring_bytes - flag)
  assert float(stats.dense_wire_bytes) == pytest.approx(2 * 7 / 8 * 4 * N)
  assert float(stats.wire_compression_factor) == pytest.approx(wire_factor)


def test_psum_compressors_keep_their_factor_on_the_wire(mesh8):
  stats, traffic = _step_traffic(
      jaxcomp.compressed_mean("bf16", "data"), mesh8, {"w": jnp.zeros((N,))})
  assert float(stats.compression_factor) == pytest.approx(2.0)
  assert float(stats.wire_compression_factor) == pytest.approx(2.0)


def test_get_stats_counts_every_compressed_mean(mesh8):
  """A multi_transform with two compressed_means: get_stats totals both,
  and by_path returns each."""
  params = {"dense": jnp.zeros((1000,)), "sparse": jnp.zeros((2000,))}
  tx = optax.multi_transform(
      {"a": jaxcomp.compressed_mean("bf16", "data"),
       "b": jaxcomp.compressed_mean("topk", "data", ratio=0.1)},
      {"dense": "a", "sparse": "b"})
  stats, _ = _step_traffic(tx, mesh8, params)
  assert float(stats.bytes_sent) == 2 * 1000 + 8 * 200
  assert float(stats.dense_bytes) == 4 * 3000
  assert float(stats.compression_factor) == pytest.approx(12000 / 3600)
  f, state, _ = sharded_update(tx, params, mesh8)
  each = jaxcomp.get_stats(state, by_path=True)
  assert len(each) == 2
  assert sorted(float(s.bytes_sent) for s in each.values()) == [1600, 2000]
  # Operand bytes in the lowered step (XLA:CPU later widens the bf16
  # all-reduce to float32): both transforms' payloads and top-k's non-finite
  # flag (bf16, stateless and dense, needs none).
  g = stacked(jax.tree.map(lambda p: jnp.ones((8, *p.shape)), params), mesh8)
  lowered = jaxcomp.collective_traffic(f.lower(g, state))
  assert lowered.operand_bytes == 2 * 1000 + 8 * 200 + 4


def test_bf16_gradients_travel_in_bf16_with_float32_residuals(mesh8):
  """Native low precision ([integration] item 6): identity of bfloat16
  gradients is a bfloat16 all-reduce (2 n bytes, as a bf16 pmean), top-k's
  values travel in bfloat16 beside int32 indices, the residual stays
  float32, and dense_bytes counts the model's own dtype."""
  n = 10_000
  params = {"w": jnp.zeros((n,), jnp.bfloat16)}
  for name, kw, sent in (("identity", {}, 2 * n),
                         ("topk", {"ratio": 0.01}, (2 + 4) * 100)):
    f, state, _ = sharded_update(
        jaxcomp.compressed_mean(name, "data", **kw), params, mesh8)
    g = stacked({"w": jnp.ones((8, n), jnp.bfloat16)}, mesh8)
    lowered = jaxcomp.collective_traffic(f.lower(g, state))
    stats = jaxcomp.get_stats(state)
    assert float(stats.bytes_sent) == sent
    assert float(stats.dense_bytes) == 2 * n
    # + the non-finite flag, which identity (stateless, every coordinate
    # sent) does without: a NaN reaches its mean by itself.
    assert lowered.operand_bytes == sent + (0 if name == "identity" else 4)
    if name == "topk":
      (residual,) = jax.tree.leaves(state.feedback)
      assert residual.dtype == jnp.float32
    u, _ = f(g, state)
    assert u["w"].dtype == jnp.bfloat16
