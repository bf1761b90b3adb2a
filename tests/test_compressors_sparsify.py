"""random-k (shared key, psum without indices) and threshold sparsification,
and scheduling their hyperparameters with optax.inject_hyperparams."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp.compressors import RandomK, Threshold, TopK
from jaxcomp._parts import concat as concat_parts
from tests.exchange_helpers import exchange_fn
from tests.helpers import run_shard_map, run_steps

N = 1000


@pytest.fixture(scope="module")
def xs():
  return jnp.asarray(np.random.default_rng(0).normal(size=(8, N)), jnp.float32)


def test_random_k_every_device_sends_the_same_coordinates(mesh8, xs):
  comp = RandomK(ratio=0.05)
  means, locs, _ = exchange_fn(mesh8, comp, N)(xs, jax.random.key(7))
  mean, locs = np.asarray(means[0]), np.asarray(locs[:, 0])
  sel = np.nonzero(mean)[0]
  assert len(sel) == 50  # k = ceil(0.05 * 1000), distinct
  for i in range(8):  # each device sent exactly these coordinates
    np.testing.assert_array_equal(np.nonzero(locs[i])[0], sel)
  np.testing.assert_allclose(mean[sel], np.asarray(xs).mean(axis=0)[sel],
                             rtol=1e-5, atol=1e-7)
  assert comp.payload_bytes(N) == 4 * 50  # values only, no indices


def test_random_k_unbiased_variant(xs):
  comp = RandomK(ratio=0.1, unbiased=True)
  assert not comp.biased
  trials = 2000
  f = jax.jit(jax.vmap(lambda k: comp.decode(comp.encode(xs[0], k), N, k)))
  ys = np.asarray(f(jax.random.split(jax.random.key(1), trials)), np.float64)
  x = np.asarray(xs[0], np.float64)
  # Per element: mean of 2000 draws of (n/k) x Bernoulli(k/n), so the
  # standard error is |x| sqrt((n/k - 1) / trials).
  se = np.abs(x) * np.sqrt(9.0 / trials)
  assert np.all(np.abs(ys.mean(axis=0) - x) <= 5 * se + 1e-6)


def test_threshold_sends_what_passes_and_keeps_the_overflow(mesh8, xs):
  # Under capacity: exactly the entries with |x| >= t.
  comp = Threshold(threshold=2.0, capacity_ratio=0.2)
  x = xs[0]
  y = np.asarray(comp.decode(comp.encode(x, None), N, None))
  np.testing.assert_array_equal(y, np.where(np.abs(x) >= 2.0, x, 0.0))
  # Over capacity (about 317 entries pass |x| >= 1, the capacity is 100):
  # the 100 largest travel, the rest stays in the residual.
  tx = jaxcomp.compressed_mean("threshold", "data", nonfinite="zero",
                               threshold=1.0, capacity_ratio=0.1)
  _, _, state, _ = run_shard_map(tx, {"w": xs}, mesh8)
  residual = np.asarray(concat_parts(state.feedback[0]))
  sent = np.asarray(xs) - residual
  for i in range(8):
    nz = np.nonzero(sent[i])[0]
    assert len(nz) == 100
    order = np.argsort(-np.abs(np.asarray(xs[i])))
    assert set(nz) == set(order[:100])
  assert np.sum(np.abs(residual) >= 1.0) > 8 * 150  # the overflow is kept


@pytest.mark.parametrize("kwargs,match", [
    (dict(ratio=0.0), "ratio"), (dict(ratio=1.5), "ratio"),
    (dict(ratio=0.5, max_ratio=0.1), "max_ratio")])
def test_random_k_bad_input(kwargs, match):
  with pytest.raises(ValueError, match=match):
    RandomK(**kwargs)
  with pytest.raises(ValueError, match=match):
    jaxcomp.compressors.get("random_block", **kwargs)


def test_bad_threshold_and_traced_ratio_without_capacity():
  with pytest.raises(ValueError, match="threshold"):
    Threshold(threshold=-1.0)
  with pytest.raises(ValueError, match="capacity_ratio"):
    Threshold(capacity_ratio=0.0)
  with pytest.raises(ValueError, match="max_ratio"):
    jax.jit(lambda r: RandomK(ratio=r).encode(jnp.zeros(10), None))(0.5)


@pytest.mark.parametrize("name", ["random_k", "random_block"])
def test_inject_hyperparams_schedules_what_is_sent(mesh8, xs, name):
  # ratio 0.2 -> 0.1 -> 0.05 over three steps, capacity fixed at 0.2.
  def make(ratio):
    return jaxcomp.compressed_mean(name, "data", nonfinite="zero",
                                   error_feedback=False, ratio=ratio,
                                   max_ratio=0.2)

  sched = optax.exponential_decay(0.2, 1, 0.5)
  tx = optax.inject_hyperparams(make)(ratio=sched)
  run = run_steps(tx, {"w": xs}, mesh8, steps=3)
  nnz = [int(jnp.sum(u["w"] != 0)) for u, _ in run.history]
  assert nnz == [200, 100, 50]
  # The wire keeps the capacity: 4 * ceil(0.2 * N) bytes every step.
  traffic = jaxcomp.collective_traffic(run.compiled())
  assert traffic.operand_bytes == 4 * 200


def test_threshold_may_be_traced(xs):
  # optax.inject_hyperparams hands the threshold in as a traced array; it
  # is a comparison, so no capacity is needed and the count follows it.
  @jax.jit
  def count(t):
    comp = Threshold(threshold=t, capacity_ratio=1.0)
    return jnp.sum(comp.encode(xs[0], None)["values"] != 0)

  x = np.abs(np.asarray(xs[0]))
  for t in (0.5, 1.0, 2.0):
    assert int(count(jnp.float32(t))) == int(np.sum(x >= t))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_topk_value_bits_sends_the_top_k_on_a_grid(mesh8, xs, bits):
  """value_bits: the same top-k set, each value within half a step of its
  level (m + 1/2) * step, signs kept, step = max|sent| / 2**(bits - 1); the
  mean is the average of what the devices contributed, and the residual
  keeps the rest (local + residual = v, exactly)."""
  comp = TopK(ratio=0.05, value_bits=bits)
  k = 50
  means, locs, _ = exchange_fn(mesh8, comp, N)(xs, jax.random.key(0))
  mean, locs = np.asarray(means[0]), np.asarray(locs[:, 0])
  for i in range(8):
    x = np.asarray(xs[i])
    sel = np.sort(np.argsort(-np.abs(x), kind="stable")[:k])
    np.testing.assert_array_equal(np.nonzero(locs[i])[0], sel)
    step = np.float32(np.abs(x[sel]).max()) / 2 ** (bits - 1)
    err = np.abs(locs[i][sel] - x[sel])
    assert np.all(err <= step / 2 * (1 + 1e-5)), (err.max(), step)
    np.testing.assert_array_equal(np.sign(locs[i][sel]), np.sign(x[sel]))
    level = np.abs(locs[i][sel]) / step - 0.5
    np.testing.assert_allclose(level, np.round(level), atol=1e-4)
    assert level.min() > -1e-3 and level.max() < 2 ** (bits - 1) - 1 + 1e-3
  np.testing.assert_allclose(mean, locs.mean(axis=0), rtol=1e-6, atol=1e-7)
  assert comp.payload_bytes(N) == 4 * k + 4 * (-(-k * bits // 32)) + 4
  # Error feedback through compressed_mean keeps what was not sent.
  tx = jaxcomp.compressed_mean("topk", "data", ratio=0.05, value_bits=bits)
  _, _, state, specs = run_shard_map(tx, {"w": xs}, mesh8)
  residual = np.asarray(state.feedback[0][0])
  np.testing.assert_array_equal(residual + locs, np.asarray(xs))


@pytest.mark.parametrize("kwargs,match", [
    ({"value_bits": 3}, "value_bits must be one of"),
    ({"value_bits": 2, "max_ratio": 0.1}, "value_bits with max_ratio"),
])
def test_topk_value_bits_bad_input(kwargs, match):
  with pytest.raises(ValueError, match=match):
    TopK(ratio=0.05, **kwargs)


@pytest.mark.parametrize("kwargs", [dict(ratio=0.01), dict(ratio=0.3),
                                    dict(ratio=0.05, value_bits=2),
                                    dict(ratio=0.2, max_ratio=0.5)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_topk_payload_formula_is_what_encode_returns(kwargs, dtype):
  """TopK states its payload arrays by formula (the perf model asks for
  thousands of sizes); they are the arrays a traced encode returns."""
  from jaxcomp.compressors.base import _payload_arrays
  comp = jaxcomp.compressors.get("topk", **kwargs)
  for n in (1, 7, 100, 4097, 1 << 20):
    assert comp.payload_arrays(n, dtype) == _payload_arrays(
        comp, n, jnp.dtype(dtype)), n
