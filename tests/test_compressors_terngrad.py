"""TernGrad: shared scale, exact sum, unbiased, 2-bit packing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from tests.exchange_helpers import exchange_fn

N = 500
TRIALS = 200


@pytest.fixture(scope="module")
def run(mesh8):
  comp = jaxcomp.compressors.get("terngrad")
  rng = np.random.default_rng(0)
  # Device scales differ by 10x, so a per-device scale would not sum exactly.
  xs = rng.normal(size=(8, N)) * np.linspace(0.1, 1.0, 8)[:, None]
  xs = jnp.asarray(xs, jnp.float32)
  f = exchange_fn(mesh8, comp, N)
  return comp, xs, f


def test_decoded_mean_is_the_mean_of_decoded_values(run):
  comp, xs, f = run
  means, locs, _ = f(xs, jax.random.key(1))
  locs = np.asarray(locs[:, 0])  # (8, N): s * t_i on each device
  scale = float(jnp.max(jnp.abs(xs)))  # shared: the max over all devices
  t = locs / scale
  np.testing.assert_array_equal(t, np.round(t))  # ternary times the scale
  assert set(np.unique(np.round(t))) <= {-1.0, 0.0, 1.0}
  np.testing.assert_allclose(np.asarray(means[0]), locs.mean(axis=0),
                             rtol=1e-6, atol=1e-7)
  # Signs agree with x wherever something is sent.
  assert np.all(np.sign(t) * np.sign(np.asarray(xs)) >= 0)


def test_unbiased_within_statistical_bound(run):
  comp, xs, f = run
  acc = np.zeros((N,))
  sq = np.zeros((N,))
  for trial in range(TRIALS):
    means, _, _ = f(xs, jax.random.key(100 + trial))
    m = np.asarray(means[0], np.float64)
    acc += m
    sq += m * m
  mean_est = acc / TRIALS
  var = sq / TRIALS - mean_est ** 2
  target = np.asarray(xs, np.float64).mean(axis=0)
  # Per element, the estimate is within 5 standard errors (plus slack for
  # elements whose variance happens to be tiny).
  se = np.sqrt(var / TRIALS) + 1e-3
  assert np.all(np.abs(mean_est - target) < 5 * se)
  # And the variance respects the TernGrad bound: per device s|x| - x^2.
  s = float(jnp.max(jnp.abs(xs)))
  x = np.asarray(xs, np.float64)
  bound = (s * np.abs(x) - x * x).sum(axis=0) / 64
  assert np.all(var <= 1.5 * bound + 1e-4)


def test_payload_packs_two_bits_per_element():
  comp = jaxcomp.compressors.get("terngrad")
  x = jnp.asarray([0.5, -1.0, 0.0, 1.0] * 8 + [1.0], jnp.float32)  # n = 33
  payload = comp.encode(x, jax.random.key(0))
  assert payload["codes"].dtype == jnp.uint32
  assert payload["codes"].shape == (3,)  # ceil(33 / 16)
  assert comp.payload_bytes(33) == 3 * 4 + 4
  y = np.asarray(comp.decode(payload, 33, None))
  # The max element and the zeros are deterministic.
  assert y[1] == -1.0 and y[3] == 1.0 and y[2] == 0.0


def test_clip_sigma_validation():
  with pytest.raises(ValueError, match="clip_sigma"):
    jaxcomp.compressors.get("terngrad", clip_sigma=0.0)
