"""The counter-based dither (jaxcomp.kernels.dither): the statistics that
unbiased stochastic rounding needs, and that every random compressor draws
from it reproducibly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxcomp.compressors.base import get
from jaxcomp.kernels import dither

N = 1 << 20


def _draws(seed: int, n: int = N) -> np.ndarray:
  return np.asarray(dither.uniform(jax.random.key(seed), n), np.float64)


def test_mix_is_a_bijection_on_a_range_of_indices():
  """Distinct counters give distinct words: no two elements share a draw."""
  idx = jnp.arange(N, dtype=jnp.uint32)
  words = np.asarray(dither.hash_bits(jnp.array([7, 11], jnp.uint32), idx))
  assert np.unique(words).size == N
  mixed = np.asarray(dither.mix(idx))
  assert np.unique(mixed).size == N


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uniform_passes_chi_square_and_moments(seed):
  u = _draws(seed)
  assert u.min() >= 0.0 and u.max() < 1.0
  counts = np.bincount((u * 256).astype(int), minlength=256)
  chi2 = ((counts - N / 256) ** 2 / (N / 256)).sum()
  # Rejected at p = 1e-4 only by a generator that is not uniform.
  assert chi2 < stats.chi2.ppf(1 - 1e-4, df=255), chi2
  # Mean 1/2 and variance 1/12, within 5 standard errors.
  assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / N)
  assert abs(u.var() - 1 / 12) < 5 * np.sqrt(1 / 180 / N)


@pytest.mark.parametrize("lag", [1, 2, 32, 1024])
def test_neighbours_and_streams_are_uncorrelated(lag):
  u = _draws(3)
  bound = 5 / np.sqrt(N)
  assert abs(np.corrcoef(u[:-lag], u[lag:])[0, 1]) < bound
  # Two keys (two devices, two steps) give unrelated streams.
  assert abs(np.corrcoef(u, _draws(4))[0, 1]) < bound


def test_offset_continues_the_stream():
  key = jax.random.key(5)
  whole = dither.uniform(key, 1000)
  np.testing.assert_array_equal(dither.uniform(key, 400, offset=600), whole[600:])
  with pytest.raises(ValueError, match="2\\*\\*32"):
    dither.uniform(key, 10, offset=2**32 - 5)


def test_bits_do_not_depend_on_where_they_are_computed():
  """Element i's number is a function of (key, i) only: jit, a slice of a
  longer draw and a typed or raw key agree bit for bit (what a kernel that
  hashes its own indices relies on)."""
  key = jax.random.key(9)
  eager = dither.uniform(key, 4096)
  jitted = jax.jit(lambda k: dither.uniform(k, 8192))(key)[:4096]
  raw = dither.uniform(jax.random.PRNGKey(9), 4096)
  np.testing.assert_array_equal(eager, jitted)
  np.testing.assert_array_equal(eager, raw)


@pytest.mark.parametrize("name,kw", [("qsgd", {"levels": 3}),
                                     ("int8_block", {"rounding": "stochastic",
                                                     "bits": 2}),
                                     ("fp8_block", {"rounding": "stochastic"})])
def test_stochastic_rounding_with_the_dither_is_unbiased(name, kw):
  """The mean of many decodes converges to x: the summed error, and the
  error summed toward each element's sign (what rounding biased toward or
  away from zero would shift), stay within 5 standard errors of the decodes'
  own spread."""
  comp = get(name, **kw)
  x = jax.random.normal(jax.random.key(0), (4096,), jnp.float32)
  trials = 400
  keys = jax.random.split(jax.random.key(1), trials)
  dec = jax.jit(jax.vmap(lambda k: comp.decode(comp.encode(x, k), x.shape[0],
                                                k)))(keys)
  dec = np.asarray(dec, np.float64)
  err = dec.mean(axis=0) - np.asarray(x, np.float64)
  se = np.sqrt(dec.var(axis=0).sum() / trials)
  assert abs(err.sum()) < 5 * se, err.sum() / se
  assert abs((np.sign(np.asarray(x)) * err).sum()) < 5 * se
  # and the rounding is random: decodes differ between keys
  assert np.mean(dec.std(axis=0) > 0) > 0.5


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 1 << 16, 1863690])
def test_permutation_prefix_gives_distinct_indices_in_range(n):
  m = min(n, 4096)
  idx = np.asarray(dither.permutation_prefix(jax.random.key(n), n, m))
  assert idx.shape == (m,) and idx.dtype == np.int32
  assert np.unique(idx).size == m and idx.min() >= 0 and idx.max() < n
  if n <= 4096:  # m = n: a whole permutation
    np.testing.assert_array_equal(np.sort(idx), np.arange(n))


def test_permutation_prefix_is_uniform_over_indices_and_slots():
  """Over many keys every index is drawn equally often, in any slot (chi
  square at p = 1e-4), which is what random-k's n / k scaling assumes."""
  n, m, trials = 50, 10, 20000
  keys = jax.random.split(jax.random.key(1), trials)
  picks = np.asarray(jax.jit(jax.vmap(
      lambda k: dither.permutation_prefix(k, n, m)))(keys))
  crit = stats.chi2.ppf(1 - 1e-4, df=n - 1)
  for counts, total in ((np.bincount(picks.ravel(), minlength=n), trials * m),
                        (np.bincount(picks[:, 0], minlength=n), trials)):
    expect = total / n
    assert ((counts - expect) ** 2 / expect).sum() < crit
  # pairs are not tied together: index 0 and index 1 appear together as
  # often as independent draws without replacement would have them
  both = np.mean(np.any(picks == 0, axis=1) & np.any(picks == 1, axis=1))
  expect = m * (m - 1) / (n * (n - 1))
  assert abs(both - expect) < 5 * np.sqrt(expect / trials)


def test_permutation_prefix_checks_its_arguments():
  with pytest.raises(ValueError, match="m=11"):
    dither.permutation_prefix(jax.random.key(0), 10, 11)
