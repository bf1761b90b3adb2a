"""Two-phase compressed all-reduce, the "auto" choice and default_for:
exactness, re-encoding error, error accounting, HLO traffic, bad input."""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp.collectives import AllGatherMean, Auto, TwoPhase
from jaxcomp._parts import concat as concat_parts
from tests.exchange_helpers import exchange_traffic
from tests.helpers import run_pmap, run_shard_map, run_steps

P_DEV = 8
# 37 and 5 are not multiples of 8; 5 and 3 are smaller than the device count.
SHAPES = ((37,), (5,), (3,))


@dataclasses.dataclass(frozen=True)
class Grid(jaxcomp.compressors.Compressor):
  """Deterministic test quantizer: rounds to multiples of 1/4 (int32 codes).
  Not linear as far as the collectives know, so it is exchanged by payload."""

  name: ClassVar[str] = "grid"

  def encode(self, x, key):
    del key
    return jnp.round(x * 4.0).astype(jnp.int32)

  def decode(self, payload, n, key):
    del n, key
    return payload.astype(jnp.float32) / 4.0


def int_grads(seed, shapes=SHAPES):
  """Integer-valued float32 gradients: every sum and mean by 8 is exact."""
  rng = np.random.default_rng(seed)
  return {f"l{i}": jnp.asarray(rng.integers(-20, 21, (P_DEV, *s)), jnp.float32)
          for i, s in enumerate(shapes)}


def real_grads(seed, shapes=SHAPES):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return {f"l{i}": jax.random.normal(k, (P_DEV, *s))
          for i, (k, s) in enumerate(zip(keys, shapes))}


@pytest.mark.parametrize("collective", [
    "psum", "allgather", "two_phase", "auto", TwoPhase(residual=False),
    jaxcomp.collectives.Zen(density=1.0)])
def test_identity_equals_pmean(mesh8, collective):
  g = int_grads(0)
  tx = jaxcomp.compressed_mean("identity", "data", collective=collective)
  u, ref, _, _ = run_shard_map(tx, g, mesh8)
  for k in g:
    np.testing.assert_array_equal(np.asarray(u[k]), np.asarray(ref[k]))


def test_two_phase_identity_under_pmap(mesh8):
  g = int_grads(1)
  u, ref, _ = run_pmap(
      jaxcomp.compressed_mean("identity", "data", collective="two_phase"), g)
  for k in g:
    np.testing.assert_array_equal(np.asarray(u[k]), np.asarray(ref[k]))


@pytest.mark.parametrize("shape", [(64,), (37,), (3,)])
def test_grid_two_phase_is_reencoded_allgather(mesh8, shape):
  """Phase 1 of the grid quantizer is exact per element, so two-phase must
  equal all-gather-then-decode re-rounded to the grid: bitwise, and within
  the re-encoding bound 1/8 of it."""
  g = real_grads(2, (shape,))
  ag, _, _, _ = run_shard_map(jaxcomp.compressed_mean(
      Grid(), "data", collective="allgather", error_feedback=False), g, mesh8)
  tp, _, state, _ = run_shard_map(jaxcomp.compressed_mean(
      Grid(), "data", collective="two_phase", error_feedback=False), g, mesh8)
  ag, tp = np.asarray(ag["l0"]), np.asarray(tp["l0"])
  np.testing.assert_array_equal(tp, np.round(ag * 4) / 4)
  assert np.max(np.abs(tp - ag)) <= 1 / 8
  assert np.any(tp != ag)  # the re-encoding did round something
  # The owners' second-phase residuals are exactly what the rounding lost.
  c = -(-shape[0] // P_DEV)
  r2 = np.asarray(state.exchange_state[0]).reshape(-1)[:shape[0]]
  assert state.exchange_state[0].shape == (P_DEV, c)
  np.testing.assert_allclose(r2, ag - tp, atol=1e-6)


def test_int8_two_phase_within_reencoding_bound(mesh8):
  if "int8_block" not in jaxcomp.compressors.names():
    pytest.skip("int8_block is not registered")
  block = 16
  comp = jaxcomp.compressors.get("int8_block", block_size=block)
  g = real_grads(3, ((P_DEV * 4 * block,),))  # chunks hold whole blocks
  ag, _, _, _ = run_shard_map(jaxcomp.compressed_mean(
      comp, "data", collective="allgather", error_feedback=False), g, mesh8)
  tp, _, _, _ = run_shard_map(jaxcomp.compressed_mean(
      comp, "data", collective="two_phase", error_feedback=False), g, mesh8)
  ag, tp = np.asarray(ag["l0"]), np.asarray(tp["l0"])
  # Chunks are whole blocks, so phase 1 decodes what the all-gather decodes;
  # re-encoding the mean with nearest rounding errs by at most half a step
  # (scale = max|block| / 127) per element.
  half_step = np.repeat(np.abs(ag).reshape(-1, block).max(axis=1), block) / 127 / 2
  assert np.all(np.abs(tp - ag) <= half_step * (1 + 1e-5) + 1e-7)
  assert np.any(tp != ag)


@pytest.mark.parametrize("name,kwargs", [("qsgd", {"levels": 2}),
                                         ("topk", {"ratio": 0.2})])
def test_two_phase_error_accounting(mesh8, name, kwargs):
  """p * sum_t mean_t == sum_i (sum_t g_i,t - e_i,T) - p * r_T, with e the
  error-feedback residuals and r the owners' second-phase residuals."""
  n = 37
  tx = jaxcomp.compressed_mean(name, "data", collective="two_phase",
                               error_feedback=True, **kwargs)
  steps = [real_grads(10 + t, ((n,),)) for t in range(3)]
  run = run_steps(tx, steps, mesh8)
  state = run.state
  sent = np.zeros(n)
  for u, _ in run.history:
    sent += np.asarray(u["l0"], np.float64)
  g_total = sum(np.asarray(g["l0"], np.float64) for g in steps)
  e = np.asarray(concat_parts(state.feedback[0]), np.float64)
  r2 = np.asarray(state.exchange_state[0], np.float64).reshape(-1)[:n]
  np.testing.assert_allclose(P_DEV * sent, (g_total - e).sum(0) - P_DEV * r2,
                             rtol=1e-5, atol=1e-4)
  assert np.max(np.abs(r2)) > 0  # phase 2 did lose something


@pytest.fixture(scope="module")
def qsgd_traffic():
  comp = jaxcomp.compressors.get("qsgd", levels=4)
  n = 4000  # not a multiple of 8 * 512: padded chunks and partial buckets
  return comp, n, {
      (name, p): exchange_traffic(coll, comp, n, p)
      for p in (2, 4, 8)
      for name, coll in (("two_phase", TwoPhase()),
                         ("allgather", AllGatherMean()))}


def test_two_phase_ring_bytes_flat_in_devices(qsgd_traffic):
  """Measure: Traffic.ring_bytes (all-to-all (g-1)/g m, all-gather (g-1) m).
  Two-phase stays within 15% of a ring all-reduce's 2 (p - 1) / p times the
  compressed size and below twice that size at every p; all-gather grows as
  (p - 1) times it."""
  comp, n, t = qsgd_traffic
  size = comp.payload_bytes(n)
  for p in (2, 4, 8):
    tp, ag = t["two_phase", p], t["allgather", p]
    assert tp.ring_bytes == TwoPhase().ring_bytes(comp, ((n,),), {"data": p})
    assert tp.operand_bytes == TwoPhase().payload_bytes(comp, ((n,),), {"data": p})
    assert set(tp.by_kind()) == {"all-to-all", "all-gather"}
    ratio = tp.ring_bytes / (2 * (p - 1) / p * size)
    assert 0.85 <= ratio <= 1.15, (p, ratio)
    assert tp.ring_bytes < 2 * size
    assert ag.ring_bytes == (p - 1) * size
  assert t["allgather", 8].ring_bytes > 3 * t["allgather", 2].ring_bytes
  assert t["two_phase", 8].ring_bytes < t["allgather", 8].ring_bytes / 3
  assert t["two_phase", 8].ring_bytes < 2 * t["two_phase", 2].ring_bytes


class TestDefaults:

  def test_default_for(self):
    get = jaxcomp.compressors.get
    d = jaxcomp.collectives.default_for
    assert isinstance(d(get("identity")), jaxcomp.collectives.PsumMean)
    assert isinstance(d(get("random_block")), jaxcomp.collectives.PsumMean)
    assert isinstance(d(get("topk")), AllGatherMean)
    assert isinstance(d(get("qsgd")), Auto)
    if "powersgd" in jaxcomp.compressors.names():
      assert isinstance(d(get("powersgd")), jaxcomp.collectives.OwnExchange)

  def test_auto_picks_fewer_ring_bytes(self):
    comp = jaxcomp.compressors.get("qsgd")
    auto = Auto()
    assert isinstance(auto.pick(comp, 4096, 2), AllGatherMean)  # a tie
    for p in (4, 8):
      assert isinstance(auto.pick(comp, 4096, p), TwoPhase)
    # Tiny buckets: the per-chunk norm dominates, all-gather sends less.
    assert isinstance(auto.pick(comp, 10, 8), AllGatherMean)
    for n, p in ((4096, 2), (4096, 8), (10, 8)):
      picked = auto.pick(comp, n, p)
      other = AllGatherMean() if isinstance(picked, TwoPhase) else TwoPhase()
      assert picked.ring_bytes(comp, ((n,),), {"data": p}) <= other.ring_bytes(comp, ((n,),), {"data": p})

  def test_qsgd_default_two_phase_in_hlo(self):
    comp = jaxcomp.compressors.get("qsgd")
    t = exchange_traffic(Auto(), comp, 4096, 8)
    assert set(t.by_kind()) == {"all-to-all", "all-gather"}
    assert t.ring_bytes == TwoPhase().ring_bytes(comp, ((4096,),), {"data": 8})


class TestBadInput:

  def test_residual_type(self):
    with pytest.raises(TypeError, match="residual"):
      TwoPhase(residual="yes")

  def test_own_exchange_compressor(self):
    if "powersgd" not in jaxcomp.compressors.names():
      pytest.skip("powersgd is not registered")
    with pytest.raises(ValueError, match="runs its own exchange"):
      jaxcomp.compressed_mean("powersgd", "data", collective="two_phase")

  def test_unknown_collective(self):
    with pytest.raises(ValueError, match="unknown collective 'ring'"):
      jaxcomp.compressed_mean("topk", "data", collective="ring")


@pytest.mark.parametrize("p", [1, 3, 20])  # 20: past the unrolled sum, a loop
def test_decode_sum_adds_every_payload_in_device_order(p):
  comp = jaxcomp.compressors.get("qsgd", levels=16)
  n = 1000
  key = jax.random.key(3)
  xs = jax.random.normal(jax.random.key(0), (p, n))
  payloads = jax.vmap(lambda x, i: comp.encode(x, jax.random.fold_in(key, i)))(xs, jnp.arange(p))
  want = comp.decode(jax.tree.map(lambda a: a[0], payloads), n, key)
  for i in range(1, p):
    want = want + comp.decode(jax.tree.map(lambda a, i=i: a[i], payloads), n, key)
  got = jax.jit(lambda pl: comp.decode_sum(pl, n, key))(payloads)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
