"""int8 / int4 / int2 and fp8 (e4m3, e5m2) block quantization."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp.compressors import FP8Block, IntBlock

N = 1000
BLOCK = 64  # does not divide N: the last block is partial


@pytest.fixture(scope="module")
def x():
  rng = np.random.default_rng(0)
  return jnp.asarray(rng.normal(size=(N,)) * np.repeat(
      rng.uniform(0.01, 10, size=16), BLOCK)[:N], jnp.float32)


def _roundtrip(comp, x, key=0):
  f = jax.jit(lambda x, k: comp.decode(comp.encode(x, k), x.shape[0], k))
  return np.asarray(f(x, jax.random.key(key)))


def _block_max(x, levels):
  xb = np.pad(np.abs(np.asarray(x)), (0, -N % BLOCK)).reshape(-1, BLOCK)
  return np.repeat(xb.max(axis=1), BLOCK)[:N] / levels


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_int_nearest_error_at_most_half_a_step(x, bits):
  comp = IntBlock(bits=bits, block_size=BLOCK)
  step = _block_max(x, 2 ** (bits - 1) - 1)
  y = _roundtrip(comp, x)
  assert np.all(np.abs(y - np.asarray(x)) <= step / 2 * (1 + 1e-5))
  assert comp.payload_bytes(N) == 4 * -(-N * bits // 32) + 4 * -(-N // BLOCK)


def test_int8_values_on_the_grid_are_exact():
  rng = np.random.default_rng(1)
  # Power-of-two scales, so that max / 127 gives the scale back exactly.
  scales = 2.0 ** rng.integers(-10, 3, size=16).astype(np.float32)
  q = rng.integers(-127, 128, size=(16, BLOCK)).astype(np.float32)
  q[:, 0] = 127  # the block maximum defines the scale
  x = jnp.asarray((q * scales[:, None]).reshape(-1))
  comp = IntBlock(bits=8, block_size=BLOCK)
  y = _roundtrip(comp, x)
  np.testing.assert_array_equal(y, np.asarray(x))


@pytest.mark.parametrize("comp", [
    IntBlock(bits=4, block_size=BLOCK, rounding="stochastic"),
    FP8Block(format="e5m2", block_size=BLOCK, rounding="stochastic")],
    ids=["int4", "fp8_e5m2"])
def test_stochastic_rounding_is_unbiased(x, comp):
  trials = 400
  f = jax.jit(jax.vmap(lambda k: comp.decode(comp.encode(x, k), N, k)))
  ys = np.asarray(f(jax.random.split(jax.random.key(3), trials)), np.float64)
  x64 = np.asarray(x, np.float64)
  err = ys.mean(axis=0) - x64
  var = ys.var(axis=0)
  # Summed over elements (any systematic bias adds up; the noise only grows
  # as a square root), plain and signed by x (a shrink towards zero adds up
  # there): within 5 standard errors.
  se = np.sqrt(var.sum() / trials)
  assert abs(err.sum()) < 5 * se + 1e-6 * np.abs(x64).sum()
  assert abs((np.sign(x64) * err).sum()) < 5 * se + 1e-6 * np.abs(x64).sum()
  assert np.mean(var > 0) > 0.5  # the rounding really is random
  # A deterministic rounding towards zero would fail the signed check:
  trunc = np.trunc(x64 / np.abs(x64).max() * 7) * np.abs(x64).max() / 7
  assert abs((np.sign(x64) * (trunc - x64)).sum()) > 5 * se


@pytest.mark.parametrize("fmt,rel", [("e4m3", 2.0 ** -4), ("e5m2", 2.0 ** -3)])
def test_fp8_nearest_matches_the_cast_and_its_error_bound(x, fmt, rel):
  comp = FP8Block(format=fmt, block_size=BLOCK)
  y = _roundtrip(comp, x)
  dtype, fmax = {"e4m3": (jnp.float8_e4m3fn, 448.0),
                 "e5m2": (jnp.float8_e5m2, 57344.0)}[fmt]
  scale = _block_max(x, fmax)
  expect = (np.asarray(x) / scale).astype(dtype).astype(np.float32) * scale
  np.testing.assert_allclose(y, expect, rtol=1e-6)
  tiny = float(jnp.finfo(dtype).smallest_subnormal)
  assert np.all(np.abs(y - np.asarray(x))
                <= rel * np.abs(np.asarray(x)) + tiny * scale)
  payload = comp.encode(x, None)
  assert payload["values"].dtype == jnp.uint8
  assert comp.payload_bytes(N) == N + 4 * 16


def test_zero_blocks_stay_zero():
  x = jnp.zeros((130,), jnp.float32)
  for comp in (IntBlock(block_size=BLOCK), FP8Block(block_size=BLOCK),
               IntBlock(bits=2, rounding="stochastic")):
    assert np.all(_roundtrip(comp, x) == 0)


def test_bad_input_raises_at_construction():
  with pytest.raises(ValueError, match="bits must be one of"):
    IntBlock(bits=3)
  with pytest.raises(ValueError, match="max_bits"):
    IntBlock(bits=8, max_bits=4)
  with pytest.raises(ValueError, match="block_size"):
    IntBlock(block_size=0)
  with pytest.raises(TypeError, match="block_size"):
    FP8Block(block_size=2.5)
  with pytest.raises(ValueError, match="format"):
    jaxcomp.compressors.get("fp8_block", format="e3m4")
  with pytest.raises(ValueError, match="rounding"):
    IntBlock(rounding="up")


def test_bits_schedule_within_max_bits(x):
  # A traced ``bits`` (optax.inject_hyperparams) quantizes with its levels
  # while the wire keeps max_bits.
  def rt(bits):
    comp = IntBlock(bits=bits, max_bits=8, block_size=BLOCK)
    return comp.decode(comp.encode(x, None), N, None)

  y2 = np.asarray(jax.jit(rt)(jnp.int32(2)))
  y8 = np.asarray(jax.jit(rt)(jnp.int32(8)))
  np.testing.assert_array_equal(y8, _roundtrip(IntBlock(block_size=BLOCK), x))
  np.testing.assert_array_equal(y2, _roundtrip(IntBlock(bits=2, block_size=BLOCK), x))
  assert IntBlock(bits=2, max_bits=8).payload_bytes(N) == IntBlock(
      bits=8).payload_bytes(N)


def test_int8_codes_come_from_the_kernel_path():
  from jaxcomp.kernels import bitpack, int8_block
  n = 1000
  x = jax.random.normal(jax.random.key(7), (n,))
  comp = jaxcomp.compressors.get("int8_block", bits=8, block_size=64,
                                 implementation="xla")
  payload = comp.encode(x, jax.random.key(0))
  q, scales = int8_block.int8_block_quantize_reference(x, block_size=64)
  words = bitpack.pack_bits_reference(
      q[:n].astype(jnp.int32).astype(jnp.uint32), 8)
  np.testing.assert_array_equal(np.asarray(payload["codes"]), np.asarray(words))
  np.testing.assert_array_equal(np.asarray(payload["scales"]),
                                np.asarray(scales))
  with pytest.raises(ValueError, match="implementation"):
    jaxcomp.compressors.get("int8_block", implementation="triton")


def test_qsgd_levels_schedule_within_max_levels(x):
  # A traced ``levels`` (optax.inject_hyperparams) quantizes to its own grid
  # (decoded values are multiples of norm / levels) while the wire keeps the
  # code width of max_levels; the same key gives the fixed-levels result.
  from jaxcomp.compressors import QSGD

  def rt(levels):
    comp = QSGD(levels=levels, max_levels=15, bucket_size=BLOCK)
    key = jax.random.key(3)
    return comp.decode(comp.encode(x, key), N, key)

  for s in (15, 3):
    y = np.asarray(jax.jit(rt)(jnp.int32(s)))
    fixed = QSGD(levels=s, bucket_size=BLOCK)
    np.testing.assert_allclose(y, _roundtrip(fixed, x, key=3), rtol=1e-6)
    xb = np.pad(np.asarray(x), (0, -N % BLOCK)).reshape(-1, BLOCK)
    unit = np.repeat(np.linalg.norm(xb, axis=1), BLOCK)[:N] / s
    steps = np.abs(y) / unit
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-4)
    assert steps.max() <= s + 1e-4
  assert QSGD(levels=3, max_levels=15).payload_bytes(N) == QSGD(
      levels=15).payload_bytes(N)
  with pytest.raises(ValueError, match="max_levels"):
    QSGD(levels=16, max_levels=15)
  with pytest.raises(ValueError, match="max_levels"):
    jax.jit(lambda s: QSGD(levels=s).encode(x, jax.random.key(0)))(3)


def test_qsgd_default_levels_fill_the_code_they_pay_for():
  """The default levels are the most its code width holds: one more level
  would need wider codes (4 levels sent 4-bit codes holding 7)."""
  from jaxcomp.compressors.qsgd import QSGD, code_bits
  comp = QSGD()
  assert code_bits(comp.levels) == comp.bits == 4
  assert code_bits(comp.levels + 1) > comp.bits
