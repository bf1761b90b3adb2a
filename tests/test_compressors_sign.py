"""Sign family: scaled sign (EF-signSGD), majority vote, 1-bit SGD."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp.kernels import bitpack
from jaxcomp._parts import concat as concat_parts
from tests.exchange_helpers import exchange_fn
from tests.helpers import run_shard_map

N = 1000  # not a multiple of 32: the last word is partly padding


@pytest.fixture(scope="module")
def xs():
  return jnp.asarray(np.random.default_rng(0).normal(size=(8, N)), jnp.float32)


def test_scaled_sign_error_is_exactly_the_projection_error(xs):
  comp = jaxcomp.compressors.get("sign")
  x = xs[0]
  payload = comp.encode(x, jax.random.key(0))
  assert payload["signs"].dtype == jnp.uint32
  assert payload["signs"].shape == (bitpack.packed_words(N, 1),) == (32,)
  y = comp.decode(payload, N, jax.random.key(0))
  scale = float(jnp.mean(jnp.abs(x)))
  np.testing.assert_array_equal(np.asarray(y),
                                np.where(np.asarray(x) < 0, -scale, scale))
  err = float(jnp.sum((y - x) ** 2))
  bound = float(jnp.sum(x * x) - jnp.sum(jnp.abs(x)) ** 2 / N)
  assert err == pytest.approx(bound, rel=1e-4)


def test_majority_vote_is_the_sign_of_the_sign_sum(mesh8, xs):
  comp = jaxcomp.compressors.get("majority_vote")
  means, locs, _ = exchange_fn(mesh8, comp, N)(xs, jax.random.key(0))
  signs = np.where(np.asarray(xs) < 0, -1.0, 1.0)
  np.testing.assert_array_equal(np.asarray(means[0]),
                                np.sign(signs.sum(axis=0)))
  np.testing.assert_array_equal(np.asarray(locs[:, 0]), signs)
  assert set(np.unique(np.asarray(means))) <= {-1.0, 0.0, 1.0}
  assert comp.payload_bytes(N) == 4 * 32


def test_onebit_reconstruction_values_are_the_means_of_each_side(xs):
  comp = jaxcomp.compressors.get("onebit")
  x = np.asarray(xs[1])
  payload = comp.encode(xs[1], jax.random.key(0))
  y = np.asarray(comp.decode(payload, N, jax.random.key(0)))
  pos, neg = x[x >= 0].mean(), x[x < 0].mean()
  np.testing.assert_allclose(y, np.where(x < 0, neg, pos), rtol=1e-5)
  assert y.sum() == pytest.approx(x.sum(), abs=1e-3)  # sum preserved
  # All-positive input: the negative value is 0, not NaN.
  y = comp.decode(comp.encode(jnp.abs(xs[1]), None), N, None)
  np.testing.assert_allclose(np.asarray(y), np.abs(x).mean(), rtol=1e-5)


def test_sign_with_error_feedback_conserves_mass(mesh8, xs):
  tx = jaxcomp.compressed_mean("sign", "data", nonfinite="zero")
  u, ref, state, _ = run_shard_map(tx, {"w": xs.reshape(8, 40, 25)}, mesh8)
  residual = concat_parts(state.feedback[0])  # (8, N): one residual per device
  # mean_i x_i == update + mean_i e_i: what was not sent is kept.
  np.testing.assert_allclose(
      np.asarray(u["w"]).reshape(-1) + np.asarray(residual).mean(axis=0),
      np.asarray(ref["w"]).reshape(-1), atol=2e-6)
  assert float(jnp.max(jnp.abs(residual))) > 0.1
