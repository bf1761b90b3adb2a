"""Zen sparse synchronisation: exactness, overflow never lost, hashing, HLO
traffic against all-gather of (index, value) pairs and dense psum."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp.collectives import AllGatherMean, PsumMean, Zen
from jaxcomp.collectives.zen import hash_index, hash_multiplier, unhash_index
from jaxcomp._parts import concat as concat_parts
from tests.exchange_helpers import exchange_traffic
from tests.helpers import run_steps

P_DEV = 8
VOCAB, DIM, BATCH = 512, 8, 32  # embedding table 512 x 8, 32 lookups/device
N = VOCAB * DIM
NNZ = BATCH * DIM  # at most this many nonzeros per device
DENSITY = NNZ / N


def embedding_grads(seed, p=P_DEV):
  """Integer-valued embedding gradients with Zipf-skewed token ids (hot rows
  are shared across devices), shape (p, VOCAB * DIM)."""
  rng = np.random.default_rng(seed)
  g = np.zeros((p, VOCAB, DIM), np.float32)
  for d in range(p):
    tokens = np.minimum(rng.zipf(1.5, BATCH) - 1, VOCAB - 1)
    values = rng.integers(1, 4, (BATCH, DIM)) * rng.choice([-1, 1], (BATCH, DIM))
    np.add.at(g[d], tokens, values.astype(np.float32))
  return g.reshape(p, N)


ZEN = Zen(density=DENSITY, capacity_factor=2.0, gather_capacity_factor=2.5)


def test_equals_dense_psum_when_capacity_suffices(mesh8):
  g = embedding_grads(0)
  # The skew makes the rows shared: far fewer distinct than 8 * 16.
  rows = np.unique(np.nonzero(g.reshape(P_DEV, VOCAB, DIM))[1])
  assert len(rows) < P_DEV * BATCH / 2
  run = run_steps(jaxcomp.compressed_mean("identity", "data", collective=ZEN),
                  {"e": jnp.asarray(g)}, mesh8)
  mean, state = run.updates["e"], run.state
  np.testing.assert_array_equal(np.asarray(mean), g.sum(0) / P_DEV)
  np.testing.assert_array_equal(np.asarray(state.exchange_state[0]), 0.0)


def test_overflow_is_never_lost(mesh8):
  """Capacities far too small: what does not fit stays in the state and is
  delivered later; p * sum_t mean_t + sum_i o_i == sum_t sum_i g_i exactly
  (integer values, division by 8), and every unit arrives eventually."""
  tiny = Zen(density=DENSITY, capacity_factor=0.25, gather_capacity_factor=0.5)
  tx = jaxcomp.compressed_mean("identity", "data", collective=tiny)
  g = embedding_grads(1)
  zero = {"e": jnp.zeros_like(jnp.asarray(g))}
  delivered = np.zeros(N, np.float64)
  steps = [{"e": jnp.asarray(g)}] * 2 + [zero] * 30
  leftovers = []
  for t, (u, state) in enumerate(run_steps(tx, steps, mesh8).history):
    delivered += P_DEV * np.asarray(u["e"], np.float64)
    o = np.asarray(state.exchange_state[0], np.float64)
    sent_in = g.sum(0) * min(t + 1, 2)
    np.testing.assert_array_equal(delivered + o.sum(0), sent_in)
    leftovers.append(np.abs(o).sum())
  assert leftovers[0] > 0  # the first step did overflow
  assert leftovers[-1] == 0  # and everything was delivered in the end
  np.testing.assert_array_equal(delivered, 2 * g.sum(0))


def test_topk_then_zen_keeps_both_errors(mesh8):
  """With a sparsifying compressor, local is its output (error feedback keeps
  the compressor's error) and the state keeps the capacity overflow."""
  g = embedding_grads(2)
  tx = jaxcomp.compressed_mean("topk", "data", ratio=DENSITY / 2,
                               collective=Zen(density=DENSITY / 2,
                                              capacity_factor=0.5))
  run = run_steps(tx, {"e": jnp.asarray(g)}, mesh8)
  mean, state = run.updates["e"], run.state
  e = np.asarray(concat_parts(state.feedback[0]), np.float64)
  o = np.asarray(state.exchange_state[0], np.float64)
  assert np.abs(e).sum() > 0 and np.abs(o).sum() > 0
  np.testing.assert_allclose(P_DEV * np.asarray(mean, np.float64) + o.sum(0),
                             (g - e).sum(0), atol=1e-4)


@pytest.mark.parametrize("m", [1, 8, 1000, 3 * 65536 + 8])
def test_hash_is_a_permutation(m):
  a = hash_multiplier(m)
  h = np.asarray(hash_index(jnp.arange(m, dtype=jnp.int32), a, m))
  np.testing.assert_array_equal(np.sort(h), np.arange(m))
  assert math.gcd(a, m) == 1 or m == 1
  back = unhash_index(jnp.asarray(h, jnp.int32), a, m)
  np.testing.assert_array_equal(np.asarray(back), np.arange(m))


def test_hash_matches_exact_arithmetic_for_large_tables():
  m = 2**31 - 8
  a = hash_multiplier(m, hash_seed=3)
  i = np.random.default_rng(0).integers(0, m, 1000)
  h = np.asarray(hash_index(jnp.asarray(i, jnp.int32), a, m))
  np.testing.assert_array_equal(h, (a * i.astype(object)) % m)
  np.testing.assert_array_equal(
      np.asarray(unhash_index(jnp.asarray(h, jnp.int32), a, m)), i)
  assert hash_multiplier(m, 0) != hash_multiplier(m, 1)  # re-hashing


def test_traffic_zen_below_allgather_below_psum(mesh8):
  """Measure: Traffic.ring_bytes from the compiled HLO, 8 devices, the
  skewed embedding gradient above (capacities that carry it exactly)."""
  ident = jaxcomp.compressors.get("identity")
  pairs = jaxcomp.compressors.get("topk", ratio=DENSITY)  # k = NNZ pairs
  zen = exchange_traffic(ZEN, ident, N, P_DEV)
  gather = exchange_traffic(AllGatherMean(), pairs, N, P_DEV)
  dense = exchange_traffic(PsumMean(), ident, N, P_DEV)
  assert zen.ring_bytes == ZEN.ring_bytes(ident, ((N,),), {"data": P_DEV})
  assert zen.operand_bytes == ZEN.payload_bytes(ident, ((N,),), {"data": P_DEV})
  assert gather.ring_bytes == (P_DEV - 1) * 8 * NNZ
  assert dense.ring_bytes == 2 * (P_DEV - 1) / P_DEV * 4 * N
  assert zen.ring_bytes < gather.ring_bytes / 1.5
  assert gather.ring_bytes < dense.ring_bytes
  # The bitmap travels as uint32 words: ceil(N / 8 / 32) per owner.
  assert any(op.kind == "all-gather" and op.operand_bytes == 4 * N // P_DEV // 32
             for op in zen.ops)


class TestBadInput:

  @pytest.mark.parametrize("kwargs,match", [
      ({"density": 0.0}, "density"), ({"density": 1.5}, "density"),
      ({"capacity_factor": 0}, "capacity_factor"),
      ({"gather_capacity_factor": -1.0}, "gather_capacity_factor"),
      ({"hash_seed": -1}, "hash_seed")])
  def test_values(self, kwargs, match):
    with pytest.raises(ValueError, match=match):
      Zen(**kwargs)

  def test_types(self):
    with pytest.raises(TypeError, match="density"):
      Zen(density="0.1")

  def test_own_exchange_compressor(self):
    if "powersgd" not in jaxcomp.compressors.names():
      pytest.skip("powersgd is not registered")
    with pytest.raises(ValueError, match="runs its own exchange"):
      jaxcomp.compressed_mean("powersgd", "data", collective="zen")
