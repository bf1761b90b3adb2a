"""Kernels vs references: exact equality, compiled on a GPU and in interpret
mode everywhere (a compiled test class and an interpret-mode subclass).

:class:`TestKernelsCompiled` runs the compiled Mosaic GPU kernels (skipped
off an NVIDIA GPU) and :class:`TestKernelsInterpret` the same cases with
``interpret=True``. Sizes are small and are not multiples of the kernels'
block (64 rows x 32 = 2048 elements here) so the padded tail is exercised.
"""

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import kernels
from jaxcomp.kernels import _autotune
from jaxcomp.kernels import _launch
from jaxcomp.kernels import _topk_select
from jaxcomp.kernels import bitpack
from jaxcomp.kernels import dither
from jaxcomp.kernels import compact
from jaxcomp.kernels import fp8_block
from jaxcomp.kernels import int8_block
from jaxcomp.kernels import qsgd
from jaxcomp.kernels import sign
from jaxcomp.kernels import topk

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
QCFG = kernels.QuantizeConfig(block_rows=64)
TCFG = topk.TopKConfig(block_rows=64, sample_size=256)


def _normal(n, dtype, seed=0):
  return jax.random.normal(jax.random.key(seed), (n,), jnp.float32).astype(dtype)


def _set(idx):
  idx = np.asarray(idx).tolist()
  assert len(set(idx)) == len(idx), "duplicate indices"
  return set(idx)


# --------------------------------------------------------------------------
# Implementation selector.
# --------------------------------------------------------------------------


def test_resolve_implementation():
  """Named implementations are returned as named; None is XLA off NVIDIA
  GPUs (on one it is measured: tests/test_autotune.py)."""
  big = 1 << 22
  if not _launch.nvidia_gpu():
    assert _autotune.resolve_implementation(None) == "xla"
    for op in ("sign", "qsgd", "int8", "fp8", "topk", "sampled_topk"):
      assert _autotune.resolve_implementation(None, op=op, n=big) == "xla"
  assert _autotune.resolve_implementation("xla") == "xla"
  assert _autotune.resolve_implementation("pallas") == "pallas"
  with pytest.raises(ValueError, match="implementation"):
    _autotune.resolve_implementation("triton")


def test_bad_knobs_raise():
  with pytest.raises(ValueError, match="block_rows"):
    sign.sign_pack(jnp.ones(10), config=kernels.QuantizeConfig(100))
  with pytest.raises(ValueError, match="multiples of 32"):
    int8_block.int8_block_quantize(jnp.ones(100), block_size=48,
                                 interpret=True)
  with pytest.raises(ValueError, match="levels"):
    qsgd.qsgd_bits(0)
  with pytest.raises(ValueError, match="k="):
    topk.topk_threshold_xla(jnp.ones(10), 11)
  with pytest.raises(ValueError, match="radix_bits"):
    topk.radix_passes(6)


# --------------------------------------------------------------------------
# Quantization.
# --------------------------------------------------------------------------


# --------------------------------------------------------------------------
# Top-k.
# --------------------------------------------------------------------------


def test_reference_order_and_ties():
  x = jnp.array([1.0, -3.0, 3.0, 0.5, -1.0, 2.0])
  v, i = topk.topk_reference(x, 4)
  np.testing.assert_array_equal(i, [1, 2, 5, 0])
  np.testing.assert_array_equal(v, [-3.0, 3.0, 2.0, 1.0])
  assert i.dtype == jnp.int32


def test_reference_ranks_nan_first_under_a_nan_unaware_top_k(monkeypatch):
  """XLA:GPU's own top-k kernel compares keys with a raw ``>``
  (openxla/xla#48119), so it never takes a NaN. Under a ``lax.top_k`` that
  behaves so (NaN ranked below everything), the reference still ranks NaN
  above +-Inf above every finite value, ties by ascending index."""
  real = jax.lax.top_k
  monkeypatch.setattr(jax.lax, "top_k", lambda v, k: real(
      jnp.where(jnp.isnan(v), -jnp.inf, v), k))
  x = _normal(4096, jnp.float32, seed=3)
  x = x.at[5].set(jnp.inf).at[700].set(jnp.nan).at[1500].set(-jnp.inf)
  x = x.at[9].set(-jnp.nan)
  _, idx = jax.jit(lambda v: topk.topk_reference(v, 6))(x)
  idx = np.asarray(idx).tolist()
  assert idx[:4] == [9, 700, 5, 1500], idx
  want = np.argsort(-np.abs(np.asarray(x)), kind="stable")
  want = [i for i in want.tolist() if np.isfinite(np.asarray(x)[i])][:2]
  assert idx[4:] == want


@pytest.mark.parametrize("n,dtype,k", [
    (n, d, k) for n, d, k in itertools.product(
        (1000, 3001), DTYPES, (7, 300))])
def test_topk_xla_matches_reference_set(n, dtype, k):
  x = _normal(n, dtype, seed=n + k)
  _, ref_i = topk.topk_reference(x, k)
  v, i = topk.topk_threshold_xla(x, k, config=TCFG)
  assert v.dtype == x.dtype and i.dtype == jnp.int32 and i.shape == (k,)
  assert _set(i) == _set(ref_i)
  assert bool(jnp.all(jnp.diff(i) > 0))  # ascending index order
  np.testing.assert_array_equal(v, x[i])


def _sample_positions(n, cfg):
  s = min(n, cfg.sample_size)
  return np.arange(s) * (n // s)


BRANCHES = ["candidates", "band", "ties_at_sample", "fallback", "dense", "all"]


def _branch_case(case):
  """``(x, k)`` that take one branch of the sampled selection under TCFG."""
  n, k = 5003, 50
  x = np.asarray(_normal(n, jnp.float32, seed=7))
  if case == "ties_at_sample":  # 20 nonzeros, k-th largest is a tied 0
    x = np.zeros(n, np.float32)
    x[np.arange(3, n, 250)] = np.arange(1, 22)[: len(range(3, n, 250))]
  elif case == "fallback":  # the sample sees only huge values: c_ge < k
    x = x * 1e-3
    x[_sample_positions(n, TCFG)] = 1e3
  elif case == "band":  # sorts only the band between two sample ranks
    k = 1000
    assert _topk_select.sample_plan(n, k, TCFG)[2] >= 1
  elif case == "dense":
    k = 4000
  elif case == "all":
    k = n
  elif case == "nonfinite":  # NaN ranks above +-Inf, above every finite
    x = x.copy()
    x[[10, 999, 4000]] = [np.nan, np.inf, -np.inf]
  elif case == "plus_minus_ties":  # +a and -a tie: the lower index first
    x = np.round(x * 2).astype(np.float32)
    k = 1000
  return jnp.asarray(x), k


@pytest.mark.parametrize("case", BRANCHES)
def test_topk_xla_every_branch(case):
  x, k = _branch_case(case)
  _, ref_i = topk.topk_reference(x, k)
  v, i = topk.topk_threshold_xla(x, k, config=TCFG)
  assert _set(i) == _set(ref_i)
  np.testing.assert_array_equal(v, x[i])


@pytest.mark.parametrize("case", BRANCHES + ["nonfinite", "plus_minus_ties"])
def test_topk_selection_forms_give_the_same_values_and_indices(case):
  """The sampled selection's two forms (``TopKConfig.selection``: ``"sort"``,
  the sample's keys sorted in full and XLA's cumulative reductions, the
  default off CPU; ``"partial"``, XLA's top-k of the sample and log-depth
  scans, CPU's) return the same values and indices on every branch:
  ``topk_exact_small``'s, i.e. lax.top_k's set of ``|x|`` (NaN above +-Inf
  above every finite value, ties to the lower index) in ascending index
  order."""
  x, k = _branch_case(case)
  want_v, want_i = topk.topk_exact_small(x, k)
  for form in topk.SELECTIONS:
    cfg = dataclasses.replace(TCFG, selection=form)
    v, i = topk.topk_threshold_xla(x, k, config=cfg)
    np.testing.assert_array_equal(i, want_i, err_msg=form)
    np.testing.assert_array_equal(v, want_v, err_msg=form)


def test_topk_selection_form_per_backend():
  """CPU takes the partial sort and log-depth scans; a named form is kept;
  any other name is refused."""
  assert jax.default_backend() == "cpu"
  assert topk.selection(topk.DEFAULT_CONFIG) == "partial"
  assert topk.SELECTION.get("gpu", "sort") == "sort"
  assert compact.log_depth_scans()
  for form in topk.SELECTIONS:
    assert topk.selection(topk.TopKConfig(selection=form)) == form
  with pytest.raises(ValueError, match="selection"):
    topk.topk_threshold_xla(jnp.ones(100), 5,
                            config=topk.TopKConfig(selection="radix"))


@pytest.mark.parametrize("m", [1, 31, 1000, 4099])
def test_compact_scan_forms_agree(m):
  """Prefix sums, running maxima and compaction: the log-depth scans and
  XLA's cumulative reductions give the same values."""
  rng = np.random.default_rng(m)
  c = rng.integers(0, 33, m).astype(np.int32)
  words = jnp.asarray(np.where(rng.random(m) < 0.3, 0,
                               rng.integers(0, 2**32, m, dtype=np.uint64)),
                      jnp.uint32)
  for log_depth in (True, False):
    np.testing.assert_array_equal(
        compact.cumsum(jnp.asarray(c), log_depth=log_depth), np.cumsum(c))
    np.testing.assert_array_equal(
        compact.cummax(jnp.asarray(c), log_depth=log_depth),
        np.maximum.accumulate(c))
  for capacity in (0, 5, 700):
    got = [compact.compact(words, capacity, log_depth=d) for d in (True, False)]
    np.testing.assert_array_equal(got[0][0], got[1][0])
    np.testing.assert_array_equal(got[0][1], got[1][1])


def test_bit_helpers():
  w = jnp.array([0b1011_0100, 0xFFFFFFFF, 0x80000001], jnp.uint32)
  np.testing.assert_array_equal(compact.select_bit(w, jnp.array([0, 31, 1])),
                                [2, 31, 31])
  np.testing.assert_array_equal(
      _topk_select.keep_lowest(w, jnp.array([2, 32, 1])),
      [0b0001_0100, 0xFFFFFFFF, 1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_topk_auto_on_both_sides_of_the_fast_path_size(dtype):
  """topk_auto switches from lax.top_k to the sampled-threshold path at
  ``fast_path_min_size()``: the same exact set in ascending index order on
  either side."""
  m = topk.fast_path_min_size()
  for n in (m - 1000, m + 1000):
    x = _normal(n, dtype, seed=n)
    k = n // 100
    v, i = topk.topk_auto(x, k, implementation="xla")
    assert _set(i) == _set(topk.topk_reference(x, k)[1])
    assert bool(jnp.all(jnp.diff(i) > 0))
    np.testing.assert_array_equal(np.asarray(v), np.asarray(x[i]))


@pytest.mark.parametrize("n", [0, 5, 32, 100, 1000])
@pytest.mark.parametrize("capacity", [0, 3, 64])
def test_compact_is_nonzero_in_index_order(n, capacity):
  """The selection primitive: the first ``capacity`` positions where the
  predicate holds, in index order, as ``jnp.nonzero`` finds them, and the
  count of all of them (the partial last word included)."""
  x = jnp.asarray(np.random.default_rng(n).normal(size=n), jnp.float32)
  pred = lambda v: v > 0.5
  idx, valid, total = compact.select(x, pred, capacity)
  (want,) = np.nonzero(np.asarray(x) > 0.5)
  assert int(total) == len(want)
  got = np.asarray(idx)[np.asarray(valid)]
  np.testing.assert_array_equal(got, want[:capacity])
  assert not np.asarray(idx)[~np.asarray(valid)].any()
  # A predicate true everywhere sets no bit past n.
  assert int(compact.count(compact.pack(x, lambda v: v == v))) == n


def _edge_case(case, n, rng, stride=1):
  """float32 ``(n,)`` inputs for the top-k edge cases; ``sample_misleads``
  puts zeros where a sample of ``stride`` looks and larger values
  everywhere else."""
  x = {
      "plus_minus_ties": lambda: np.where(rng.random(n) < 0.5, 1.0, -1.0)
                                 * rng.integers(1, 4, n),
      "all_equal": lambda: np.full(n, 2.5),
      "all_zero": lambda: np.zeros(n),
      "negative_zero": lambda: np.where(np.arange(n) % 2, -0.0, 0.0),
      "multi_block": lambda: rng.normal(size=n),
      "sample_misleads": lambda: np.where(np.arange(n) % stride != 0,
                                          1.0 + rng.random(n), 0.0),
  }[case]()
  return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("case", ["plus_minus_ties", "all_equal", "all_zero",
                                  "negative_zero", "multi_block"])
@pytest.mark.parametrize("k", [0, 1, 37])
def test_topk_edge_cases_match_the_reference_set(case, k):
  """Ties between +a and -a go to the lower index, as lax.top_k of |x| does;
  all-equal and all-zero inputs, -0.0, k = 0 and inputs of many blocks."""
  n = {"multi_block": 3 * 256 * 32 + 17}.get(case, 1000)
  x = _edge_case(case, n, np.random.default_rng(1))
  _, want = topk.topk_reference(x, k)
  for got in (topk.topk_threshold_xla(x, k)[1], topk.topk_exact_small(x, k)[1]):
    np.testing.assert_array_equal(np.sort(np.asarray(got)), np.sort(np.asarray(want)))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_integer_rounding_is_xlas_conversion(fmt):
  """The fp8 kernel's rounding (integer operations only) against XLA's
  ``astype(float8)`` on every fp8 value, every midpoint between neighbours
  and the floats either side of it, uniform and subnormal-range random
  values, +-0 and NaN (about 600,000 values); and its decoding of every
  finite code against XLA's."""
  _, bias, fmax, _, dt = fp8_block.FP8_FORMATS[fmt]
  codes = jnp.arange(256, dtype=jnp.uint32)
  vals = np.asarray(jax.lax.bitcast_convert_type(codes.astype(jnp.uint8), dt)
                    .astype(jnp.float32))
  finite = np.isfinite(vals)
  np.testing.assert_array_equal(np.asarray(fp8_block._fp8_value(codes, fmt))[finite],
                                vals[finite])
  grid = np.unique(vals[finite & (np.abs(vals) <= fmax)])
  mids = (grid[1:] + grid[:-1]) / 2
  rng = np.random.default_rng(0)
  y = np.concatenate([
      grid, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
      rng.uniform(-fmax, fmax, 200_000), rng.normal(size=200_000) * 1e-3,
      rng.normal(size=200_000) * 2.0 ** (-bias - 3), [0.0, -0.0, np.nan, -np.nan, 1e-45]
  ]).astype(np.float32)
  y = jnp.asarray(y[np.isnan(y) | (np.abs(y) <= fmax)])
  want = jax.lax.bitcast_convert_type(y.astype(dt), jnp.uint8).astype(jnp.uint32)
  got = jax.jit(lambda v: fp8_block._fp8_code(v, fmt))(y)
  assert y.size > 590_000
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _fp8_boundary_case(fmt: str, block: int):
  """Inputs on which fp8 rounding differences would show, with the uniform
  numbers that decide their stochastic rounding: ``(x float32 (n,), u
  float32 (n,))``, ``n`` a whole number of ``block``-element blocks.

  Each block starts with ``F`` (the format's largest value, ``F / 2**3`` in
  the scaled half), so that its scale is a power of two and ``y = x / scale``
  is exact: the values ``y`` of a block are then exactly every fp8 value,
  every midpoint between neighbours (ties to even) and the floats either
  side of it, a quarter and three quarters of the way between neighbours,
  and the subnormal ones, either sign, and ``-0.0``. ``u`` is 1/4, 1/2 or
  3/4 (where it equals the probability of the far neighbour: ``u < p``
  decides), or a float32 ulp either side of one of them.
  """
  _, _, fmax, _, dt = fp8_block.FP8_FORMATS[fmt]
  vals = np.asarray(jax.lax.bitcast_convert_type(
      jnp.arange(256, dtype=jnp.uint32).astype(jnp.uint8), dt).astype(jnp.float32))
  grid = np.unique(vals[np.isfinite(vals) & (vals >= 0) & (vals <= fmax)])
  lo, gap = grid[:-1], np.diff(grid)
  mids = lo + gap / 2
  y = np.concatenate([grid, mids, np.nextafter(mids, np.inf),
                      np.nextafter(mids, -np.inf), lo + gap / 4,
                      lo + 3 * gap / 4]).astype(np.float32)
  y = np.concatenate([y, -y, [-0.0]]).astype(np.float32)
  quarters = np.array([0.25, 0.5, 0.75], np.float32)
  us = np.concatenate([quarters, np.nextafter(quarters, np.float32(0)),
                       np.nextafter(quarters, np.float32(1))])
  y = np.repeat(y, us.size)
  u = np.tile(us, y.size // us.size)
  per_block = block - 1
  pad = -y.size % per_block
  y = np.pad(y, (0, pad)).reshape(-1, per_block)
  u = np.pad(u, (0, pad)).reshape(-1, per_block)
  first = np.full((y.shape[0], 1), fmax, np.float32)
  x = np.concatenate([first, y], axis=1)  # scale 1: y = x
  scaled = x * np.float32(2.0 ** -3)  # scale 2**-3: y = 8 x, exact
  u = np.concatenate([np.full_like(first, 0.5), u], axis=1)
  return (jnp.asarray(np.concatenate([x, scaled]).reshape(-1)),
          jnp.asarray(np.concatenate([u, u]).reshape(-1)))


_HLO_OP_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[[^\]]*\]\S*\s+([\w\-]+)\(%?([\w.\-]*)")


def _float_convert_chains(hlo: str) -> list[str]:
  """Lines of an optimized HLO module that convert to a float type a value
  converted to a float type (``f32 -> f8 -> f32``): the chains that XLA's
  GPU pipeline removes as excess precision (SimplifyFPConversions), which
  changes what the program computes."""
  found, ops = [], {}
  for line in hlo.splitlines():
    if line.rstrip().endswith("{"):
      ops = {}  # a new computation
    m = _HLO_OP_RE.match(line)
    if not m:
      continue
    name, dtype, opcode, operand = m.groups()
    ops[name] = (dtype, opcode)
    inner = ops.get(operand)
    if (opcode == "convert" and _FLOAT_HLO_TYPE.match(dtype) and inner
        and inner[1] == "convert" and _FLOAT_HLO_TYPE.match(inner[0])):
      found.append(line.strip())
  return found


_FLOAT_HLO_TYPE = re.compile(r"^(f8\w*|bf16|f16|f32|f64)$")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_reference_holds_no_float_round_trip(fmt):
  """The fp8 reference's stochastic rounding takes the nearest code's value
  from its bits: it converts no float32 -> fp8 -> float32. XLA on a GPU
  removes such a round trip (excess precision), which made the reference's
  value of the nearest code ``y`` itself there, every probability 0 and its
  codes nearest, not stochastic: a quarter of them one off the kernel's on
  an H200. This CPU checks the optimized program for the chain."""
  f = lambda x, s: fp8_block.fp8_block_quantize_reference(
      x, block_size=128, format=fmt, seed=s)
  hlo = jax.jit(f).lower(jax.ShapeDtypeStruct((4096,), jnp.float32),
                         jax.ShapeDtypeStruct((2,), jnp.uint32)).compile().as_text()
  assert "convert" in hlo
  assert _float_convert_chains(hlo) == []
  # The check sees the chain where there is one.
  chain = lambda y: jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(
      y.astype(jnp.float8_e4m3fn), jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)
  hlo = jax.jit(chain).lower(jax.ShapeDtypeStruct((64,), jnp.float32)).compile().as_text()
  assert len(_float_convert_chains(hlo)) == 1, hlo


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_dequantize_takes_values_from_bits(fmt):
  """The fp8 decoder equals XLA's conversion of every finite code times the
  block's scale, and a program that encodes and decodes holds no float
  round trip (which XLA on a GPU would fold to the unrounded value)."""
  _, _, _, _, dt = fp8_block.FP8_FORMATS[fmt]
  codes = jnp.arange(256, dtype=jnp.uint32).astype(jnp.uint8)
  scales = jnp.array([0.5, 3.0], jnp.float32)
  got = fp8_block.fp8_block_dequantize_reference(codes, scales, block_size=128,
                                                n=256, format=fmt)
  want = (jax.lax.bitcast_convert_type(codes, dt).astype(jnp.float32)
          * jnp.repeat(scales, 128))
  finite = np.isfinite(np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got)[finite], np.asarray(want)[finite])

  def roundtrip(x, s):
    codes, scales = fp8_block.fp8_block_quantize_reference(
        x, block_size=128, format=fmt, seed=s)
    return fp8_block.fp8_block_dequantize_reference(
        codes, scales, block_size=128, n=x.size, format=fmt)

  hlo = jax.jit(roundtrip).lower(jax.ShapeDtypeStruct((4096,), jnp.float32),
                                 jax.ShapeDtypeStruct((2,), jnp.uint32)).compile().as_text()
  assert _float_convert_chains(hlo) == []

class TestKernelsCompiled:
  """The Pallas kernels against their references, compiled (Mosaic GPU):
  skipped off an NVIDIA GPU, where :class:`TestKernelsInterpret` runs the
  same cases in interpret mode."""

  INTERPRET = False

  def setup_method(self):
    if not self.INTERPRET and not _launch.nvidia_gpu():
      pytest.skip("the Pallas kernels compile only on an NVIDIA GPU backend")

  @pytest.mark.parametrize("n,dtype", list(itertools.product((1000, 3001, 2304),
                                                            DTYPES)))
  def test_sign_pack_matches_reference(self, n, dtype):
    x = _normal(n, dtype, seed=n)
    words, scale = sign.sign_pack(x, config=QCFG, interpret=self.INTERPRET)
    ref_words, ref_scale = sign.sign_pack_reference(x)
    assert words.shape == (bitpack.packed_words(n, 1),)
    np.testing.assert_array_equal(words, ref_words)
    np.testing.assert_array_equal(
        words, bitpack.pack_bits_reference((x < 0).astype(jnp.uint32), 1))
    np.testing.assert_allclose(scale, ref_scale, rtol=1e-6)
    decoded = sign.sign_unpack_reference(words, scale, n)
    np.testing.assert_array_equal(decoded < 0, x < 0)
    np.testing.assert_allclose(jnp.abs(decoded), scale)

  @pytest.mark.parametrize("n,dtype,levels", [
      (1000, jnp.float32, 1), (3001, jnp.float32, 7), (3001, jnp.bfloat16, 127),
      (2304, jnp.float32, 15),
      (2500, jnp.float16, 3), (1000, jnp.float32, 1000)])
  def test_qsgd_matches_reference(self, n, dtype, levels):
    x = _normal(n, dtype, seed=n)
    u = jax.random.uniform(jax.random.key(1), (n,))
    words, norms = qsgd.qsgd_quantize(
        x, u, levels=levels, bucket_size=128, config=QCFG, interpret=self.INTERPRET)
    ref_words, ref_norms = qsgd.qsgd_quantize_reference(
        x, u, levels=levels, bucket_size=128)
    bits = qsgd.qsgd_bits(levels)
    assert words.shape == (bitpack.packed_words(n, bits),)
    # The kernel computes the norms (bucket 128 is one-pass): their
    # summation order and the kernel's sqrt may move the last bits, and the
    # codes are the reference's under the kernel's own norms.
    np.testing.assert_array_equal(words, qsgd.qsgd_codes_reference(
        x, norms, u, levels=levels, bucket_size=128))
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-6)
    if self.INTERPRET:
      np.testing.assert_array_equal(words, ref_words)
    # Decoding is within one level of the input.
    y = qsgd.qsgd_dequantize_reference(words, norms, n=n, levels=levels,
                                           bucket_size=128)
    err = jnp.abs(y - x.astype(jnp.float32))
    bound = jnp.repeat(norms, 128)[:n] / levels
    assert bool(jnp.all(err <= bound * (1 + 1e-5)))
    assert bool(jnp.all((y == 0) | (jnp.sign(y) == jnp.sign(x.astype(jnp.float32)))))

  @pytest.mark.parametrize("n,dtype,levels,bucket", [
      (20_000, jnp.float32, 7, 128),  # 3 blocks of 64 buckets, last partial
      (40_960, jnp.float32, 127, 256),  # whole blocks of 64 buckets
      (70_001, jnp.bfloat16, 7, 512),  # 3 blocks, bf16, partial bucket
      (3001, jnp.float32, 1, 32),  # 2-bit codes, buckets of 32: 4 a row
      (5000, jnp.float32, 4000, 96),  # 3 rows: the XLA-norm fallback
  ])
  def test_qsgd_seed_dither_in_kernel(self, n, dtype, levels, bucket):
    """The kernel draws element i's number from (seed, i) itself: the codes
    are those of the reference fed ``dither.uniform(key, n)`` under the
    kernel's own norms, which match XLA's up to summation order."""
    x = _normal(n, dtype, seed=n).at[bucket:3 * bucket].set(0)  # zero buckets
    key = jax.random.key(n)
    seed = dither.seed_of(key)
    words, norms = qsgd.qsgd_quantize(
        x, levels=levels, bucket_size=bucket, seed=seed, config=QCFG,
        interpret=self.INTERPRET)
    u = dither.uniform(key, n)
    bits = qsgd.qsgd_bits(levels)
    assert words.shape == (bitpack.packed_words(n, bits),)
    assert norms.shape == (-(-n // bucket),)
    np.testing.assert_array_equal(words, qsgd.qsgd_codes_reference(
        x, norms, u, levels=levels, bucket_size=bucket))
    np.testing.assert_array_equal(words, qsgd.qsgd_codes_reference(
        x, norms, levels=levels, bucket_size=bucket, seed=seed))
    ref_norms = qsgd.qsgd_norms_reference(x, bucket_size=bucket)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-6)
    np.testing.assert_array_equal(norms[1:3], 0.0)
    if bucket == 96:
      # The fallback takes XLA's norms: the reference bit for bit.
      np.testing.assert_array_equal(words, qsgd.qsgd_quantize_reference(
          x, u, levels=levels, bucket_size=bucket)[0])
    # Decoding with the kernel's own norms is within one level of x.
    y = qsgd.qsgd_dequantize_reference(words, norms, n=n, levels=levels,
                                           bucket_size=bucket)
    bound = kernels.per_element(norms, bucket, n) / levels
    assert bool(jnp.all(jnp.abs(y - x.astype(jnp.float32))
                        <= bound * (1 + 1e-5)))
    np.testing.assert_array_equal(y[bucket:3 * bucket], 0.0)

  def test_seed_or_uniform_not_both(self):
    x = jnp.ones(256)
    seed = dither.seed_of(jax.random.key(0))
    with pytest.raises(ValueError, match="not both"):
      qsgd.qsgd_quantize(x, x, seed=seed, levels=7, bucket_size=128,
                             config=QCFG, interpret=self.INTERPRET)
    with pytest.raises(ValueError, match="uniform= or seed="):
      qsgd.qsgd_quantize(x, levels=7, bucket_size=128, config=QCFG,
                             interpret=self.INTERPRET)
    with pytest.raises(ValueError, match="not both"):
      int8_block.int8_block_quantize(x, block_size=64, stochastic_uniform=x,
                                   seed=seed, config=QCFG,
                                   interpret=self.INTERPRET)
    with pytest.raises(ValueError, match="seed must be uint32"):
      qsgd.qsgd_quantize_reference(x, levels=7, bucket_size=128,
                                       seed=jnp.zeros(3, jnp.uint32))

  @pytest.mark.parametrize("n,dtype,block,stochastic", [
      (20_000, jnp.float32, 128, True),  # 3 blocks of 64 scale blocks
      (20_000, jnp.float32, 256, False),
      (70_001, jnp.bfloat16, 512, True),  # bf16, partial last block
      (40_960, jnp.float32, 256, True),  # whole blocks
      (5000, jnp.float32, 96, True),  # the XLA-scale fallback
  ])
  def test_int8_block_seed_and_multi_block(self, n, dtype, block, stochastic):
    """Scales are maxima, so the one-pass kernel's equal XLA's exactly and
    the codes are the reference's bit for bit (stochastic with the seed
    against the reference fed ``dither.uniform(key, n)``)."""
    x = _normal(n, dtype, seed=n).at[block:2 * block].set(0)
    key = jax.random.key(n)
    seed = dither.seed_of(key) if stochastic else None
    q, scales = int8_block.int8_block_quantize(
        x, block_size=block, seed=seed, config=QCFG, interpret=self.INTERPRET)
    ref_q, ref_scales = int8_block.int8_block_quantize_reference(
        x, block_size=block,
        stochastic_uniform=dither.uniform(key, n) if stochastic else None)
    assert q.shape == ref_q.shape and q.dtype == jnp.int8
    np.testing.assert_array_equal(q, ref_q)
    np.testing.assert_array_equal(scales, ref_scales)
    assert scales[1] == 0 and bool(jnp.all(q[block:2 * block] == 0))

  @pytest.mark.parametrize("n,dtype", [(1 << 15, jnp.float32),
                                       (40_000, jnp.bfloat16),
                                       (8192 + 256, jnp.float32)])
  def test_sign_pack_multi_block(self, n, dtype):
    x = _normal(n, dtype, seed=n).at[:512].set(0)
    words, scale = sign.sign_pack(x, config=QCFG, interpret=self.INTERPRET)
    ref_words, ref_scale = sign.sign_pack_reference(x)
    np.testing.assert_array_equal(words, ref_words)
    np.testing.assert_allclose(scale, ref_scale, rtol=1e-6)

  @pytest.mark.parametrize("fmt,n,dtype,block,stochastic", [
      ("e4m3", 20_000, jnp.float32, 128, False),  # partial last block
      ("e5m2", 20_000, jnp.float32, 256, True),
      ("e4m3", 40_960, jnp.bfloat16, 256, True),  # whole blocks, read in place
      ("e5m2", 12_001, jnp.float16, 512, False),
      ("e4m3", 5000, jnp.float32, 96, True),  # the XLA-scale fallback
  ])
  def test_fp8_block_matches_reference(self, fmt, n, dtype, block, stochastic):
    """The fp8 kernel's codes and scales equal the XLA reference's bit for
    bit: its integer rounding is XLA's conversion (nearest even, with the
    subnormals, -0.0, the largest value and ties), and its stochastic
    rounding draws the reference's numbers from the seed. A zero block stays
    zero; an infinity gives its block a non-finite scale on both paths and
    leaves the other blocks as they were."""
    x = _normal(n, dtype, seed=n).at[block:2 * block].set(0)
    x = x.at[5].set(-0.0).at[7].set(1e-30).at[9].set(-3.0)
    key = jax.random.key(n)
    seed = dither.seed_of(key) if stochastic else None
    codes, scales = fp8_block.fp8_block_quantize(
        x, block_size=block, format=fmt, seed=seed, config=QCFG,
        interpret=self.INTERPRET)
    ref_codes, ref_scales = fp8_block.fp8_block_quantize_reference(
        x, block_size=block, format=fmt, seed=seed)
    assert codes.shape == (n,) and codes.dtype == jnp.uint8
    np.testing.assert_array_equal(scales, ref_scales)
    np.testing.assert_array_equal(codes, ref_codes)
    assert scales[1] == 0 and bool(jnp.all((codes[block:2 * block] & 0x7F) == 0))
    bad = x.at[3].set(jnp.inf)
    got, got_scales = fp8_block.fp8_block_quantize(
        bad, block_size=block, format=fmt, config=QCFG, interpret=self.INTERPRET)
    want, want_scales = fp8_block.fp8_block_quantize_reference(bad, block_size=block,
                                                              format=fmt)
    assert not np.isfinite(float(got_scales[0])) and not np.isfinite(float(want_scales[0]))
    np.testing.assert_array_equal(got[block:], want[block:])
    np.testing.assert_array_equal(got_scales[1:], want_scales[1:])

  @pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
  @pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
  def test_fp8_codes_equal_the_reference_at_rounding_boundaries(self, fmt, rounding):
    """Bit for bit on the values where a different rounding would show
    (:func:`_fp8_boundary_case`: every fp8 value, the midpoints and the
    floats either side of them, -0.0, subnormals; stochastically, numbers
    equal to each probability and an ulp either side): the kernel's codes
    and scales are the XLA reference's, and stochastic codes are the
    nearest code or its neighbour towards ``y``."""
    block = 128
    x, u = _fp8_boundary_case(fmt, block)
    u = u if rounding == "stochastic" else None
    codes, scales = fp8_block.fp8_block_quantize(
        x, block_size=block, format=fmt, stochastic_uniform=u, config=QCFG,
        interpret=self.INTERPRET)
    want, want_scales = fp8_block.fp8_block_quantize_reference(
        x, block_size=block, format=fmt, stochastic_uniform=u)
    np.testing.assert_array_equal(scales, want_scales)
    assert set(np.unique(np.asarray(scales))) == {1.0, 2.0 ** -3}
    np.testing.assert_array_equal(codes, want)
    near, _ = fp8_block.fp8_block_quantize_reference(x, block_size=block, format=fmt)
    step = np.abs(np.asarray(codes, np.int32) - np.asarray(near, np.int32))
    if rounding == "nearest":
      assert not step.any()
    else:  # both neighbours are taken, and nothing further
      assert set(np.unique(step)) == {0, 1}

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  def test_16_bit_inputs_read_in_place_equal_their_float32_values(self, dtype):
    """Whole tiles (whole blocks in interpret mode) of bfloat16 / float16
    go to the kernel in their own dtype and are converted in registers: the
    words and statistics equal those of the same values in float32, bit for
    bit (the conversion is exact)."""
    n = 1 << 16
    x = _normal(n, dtype, seed=7)
    xf = x.astype(jnp.float32)
    seed = dither.seed_of(jax.random.key(1))
    kw = dict(config=QCFG, interpret=self.INTERPRET)
    for f in (lambda v: sign.sign_pack(v, **kw),
              lambda v: int8_block.int8_block_quantize(v, block_size=256, **kw),
              lambda v: int8_block.int8_block_quantize(v, block_size=256, seed=seed, **kw),
              lambda v: qsgd.qsgd_quantize(v, levels=7, bucket_size=128, seed=seed,
                                               **kw)):
      for got, want in zip(f(x), f(xf)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

  def test_qsgd_uint32_bits_and_zero_bucket(self):
    n = 700
    x = _normal(n, jnp.float32).at[:256].set(0.0)  # two all-zero buckets
    bits = jax.random.bits(jax.random.key(3), (n,), jnp.uint32)
    got = qsgd.qsgd_quantize(x, bits, levels=15, bucket_size=128,
                                 config=QCFG, interpret=self.INTERPRET)
    ref = qsgd.qsgd_quantize_reference(x, bits, levels=15, bucket_size=128)
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1][:2], 0.0)
    codes = bitpack.unpack_bits_reference(got[0], 8, n)
    np.testing.assert_array_equal(codes[:256], 0)

  @pytest.mark.parametrize("n,dtype,stochastic", [
      (1000, jnp.float32, False), (3001, jnp.bfloat16, False),
      (4352, jnp.float32, False),
      (3001, jnp.float16, True), (2500, jnp.float32, True)])
  def test_int8_block_matches_reference(self, n, dtype, stochastic):
    x = _normal(n, dtype, seed=n).at[:64].set(0)  # first block all zero
    u = jax.random.uniform(jax.random.key(2), (n,)) if stochastic else None
    q, scales = int8_block.int8_block_quantize(
        x, block_size=64, stochastic_uniform=u, config=QCFG,
        interpret=self.INTERPRET)
    ref_q, ref_scales = int8_block.int8_block_quantize_reference(
        x, block_size=64, stochastic_uniform=u)
    assert q.dtype == jnp.int8 and q.shape == (-(-n // 64) * 64,)
    np.testing.assert_array_equal(q, ref_q)
    np.testing.assert_array_equal(scales, ref_scales)
    assert scales[0] == 0 and bool(jnp.all(q[:64] == 0))
    y = int8_block.int8_block_dequantize_reference(q, scales, block_size=64, n=n)
    step = jnp.repeat(scales, 64)[:n]
    limit = step * (1.0 if stochastic else 0.5) * (1 + 1e-5)
    assert bool(jnp.all(jnp.abs(y - x.astype(jnp.float32)) <= limit))

  def test_int8_round_half_to_even(self):
    x = jnp.array([127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 26)
    q, scales = int8_block.int8_block_quantize(x, block_size=32, config=QCFG,
                                             interpret=self.INTERPRET)
    assert scales[0] == 1.0
    np.testing.assert_array_equal(q[:6], [127, 0, 2, 2, 0, -2])

  @pytest.mark.parametrize("n,dtype,k", [
      (3001, jnp.float32, 30), (2049, jnp.bfloat16, 1), (1000, jnp.float16, 1000),
      (2304, jnp.float32, 20)])
  def test_topk_pallas_matches_reference_set(self, n, dtype, k):
    x = _normal(n, dtype, seed=n)
    _, ref_i = topk.topk_reference(x, k)
    v, i = topk.topk(x, k, config=TCFG, interpret=self.INTERPRET)
    assert _set(i) == _set(ref_i)
    assert bool(jnp.all(jnp.diff(i) > 0))
    np.testing.assert_array_equal(v, x[i])

  def test_topk_pallas_selection_forms_agree(self):
    """The Pallas top-k under both forms of the sampled selection
    (``TopKConfig.selection``) returns the reference set in ascending index
    order, the same values and indices."""
    x = _normal(3001, jnp.float32, seed=11)
    want_v, want_i = topk.topk_exact_small(x, 30)
    for form in topk.SELECTIONS:
      cfg = dataclasses.replace(TCFG, selection=form)
      v, i = topk.topk(x, 30, config=cfg, interpret=self.INTERPRET)
      np.testing.assert_array_equal(i, want_i, err_msg=form)
      np.testing.assert_array_equal(v, want_v, err_msg=form)

  def test_topk_pallas_ties_take_lowest_indices(self):
    x = jnp.zeros(3001).at[jnp.arange(5, 3001, 100)].set(-2.0)  # 30 ties
    k = 45  # 30 nonzero ties at -2.0, then 15 of the tied zeros
    _, i = topk.topk(x, k, config=TCFG, interpret=self.INTERPRET)
    _, ref_i = topk.topk_reference(x, k)
    assert _set(i) == _set(ref_i)
    assert set(range(15)) <= _set(i)

  @pytest.mark.parametrize("case", ["plus_minus_ties", "all_equal", "all_zero",
                                    "negative_zero", "multi_block",
                                    "sample_misleads"])
  @pytest.mark.parametrize("k", [0, 1, 37])
  def test_topk_pallas_edge_cases_match_the_reference_set(self, case, k):
    """The one-pass Pallas top-k (sampled bracket, one mask kernel, the
    radix select only in the fallback branch) on the edge cases: +a / -a
    ties to the lower index, all-equal, all-zero, -0.0, k = 0, several
    blocks, and a sample that misses every large value (the candidates
    overflow and the exact branch runs)."""
    n = {"multi_block": 3 * TCFG.block_rows * 32 + 17}.get(case, 1000)
    x = _edge_case(case, n, np.random.default_rng(2),
                   stride=n // topk.sample_size(TCFG))
    _, want = topk.topk_reference(x, k)
    v, i = topk.topk(x, k, config=TCFG, interpret=self.INTERPRET)
    np.testing.assert_array_equal(np.sort(np.asarray(i)),
                                  np.sort(np.asarray(want)))
    np.testing.assert_array_equal(v, x[i])

  def test_nonfinite_inputs_poison_only_their_own_bucket(self):
    """Called directly (compressed_mean screens non-finite gradients first),
    the kernels and the references keep to the contract of
    kernels/_blocks.py: buckets without a NaN or Inf are unaffected and
    their codes equal the reference's; a QSGD bucket with either, and an
    int8 block with an Inf, get a non-finite norm / scale; sign packing
    gives a NaN an unset bit (``NaN < 0`` is false) and a non-finite scale;
    top-k ranks NaN above +-Inf above every finite value (by bit pattern)."""
    n = 4096
    x = _normal(n, jnp.float32, seed=3)
    x = x.at[5].set(jnp.nan).at[700].set(jnp.inf).at[1500].set(-jnp.inf)
    seed = dither.seed_of(jax.random.key(1))
    cases = [
        ("qsgd", 128, 4,
         qsgd.qsgd_quantize_reference(x, levels=7, bucket_size=128,
                                          seed=seed),
         qsgd.qsgd_quantize(x, levels=7, bucket_size=128, seed=seed,
                                config=QCFG, interpret=self.INTERPRET)),
        ("int8", 256, 8,
         int8_block.int8_block_quantize_reference(x, block_size=256),
         int8_block.int8_block_quantize(x, block_size=256, config=QCFG,
                                      interpret=self.INTERPRET))]
    poisoned = lambda size: sorted({5 // size, 700 // size, 1500 // size})
    for name, size, bits, (rc, rs), (pc, ps) in cases:
      for stat in (rs, ps):
        bad = set(np.nonzero(~np.isfinite(np.asarray(stat)))[0].tolist())
        must = set(poisoned(size)) if name == "qsgd" else {
            700 // size, 1500 // size}  # int8: the blocks holding an Inf
        assert must <= bad <= set(poisoned(size)), (name, bad)
      if name == "qsgd":
        rc = bitpack.unpack_bits_reference(rc, bits, n)
        pc = bitpack.unpack_bits_reference(pc, bits, n)
      keep = ~np.isin(np.arange(n) // size, poisoned(size))
      np.testing.assert_array_equal(np.asarray(pc)[:n][keep],
                                    np.asarray(rc)[:n][keep])
    words, scale = sign.sign_pack(x, config=QCFG, interpret=self.INTERPRET)
    ref_words, ref_scale = sign.sign_pack_reference(x)
    np.testing.assert_array_equal(words, ref_words)
    assert not np.isfinite(float(scale)) and not np.isfinite(float(ref_scale))
    _, want = topk.topk_reference(x, 5)
    assert set(np.asarray(want)[:3].tolist()) == {5, 700, 1500}
    _, got = topk.topk(x, 5, config=TCFG, interpret=self.INTERPRET)
    assert _set(got) == _set(want)

  @pytest.mark.parametrize("radix_bits", [5, 3])
  def test_radix_select_is_kth_largest_key(self, radix_bits):
    x = _normal(3001, jnp.float32, seed=11)
    rows, _ = _launch.to_rows(x, 64)
    k = jnp.int32(77)
    t = jax.jit(lambda r: topk.radix_select(r, 77, block_rows=64,
                                            radix_bits=radix_bits,
                                            interpret=self.INTERPRET))(rows)
    assert int(t) == int(jnp.sort(topk.abs_key(x))[-k])

  def test_sampled_topk(self):
    n, k = 3001, 30
    x = _normal(n, jnp.float32, seed=5) * 0.01
    big = jnp.arange(3, n, 10)  # 300 equal winners: the sample finds them
    x = x.at[big].set(10.0)
    key = jax.random.key(0)
    v, i = topk.sampled_topk(x, k, key, sample_ratio=0.1, implementation="xla")
    vp, ip = topk.sampled_topk(x, k, key, sample_ratio=0.1,
                               implementation="pallas", config=TCFG,
                               interpret=self.INTERPRET)
    np.testing.assert_array_equal(i, ip)
    np.testing.assert_array_equal(v, vp)
    assert i.shape == (k,) and i.dtype == jnp.int32
    valid = v != 0
    assert bool(jnp.all(jnp.diff(i[valid]) > 0))
    np.testing.assert_array_equal(v[valid], x[i[valid]])
    np.testing.assert_array_equal(i[~valid], 0)  # padding: index 0, value 0
    np.testing.assert_array_equal(i, big[:k])  # all pass: lowest k indices
    np.testing.assert_array_equal(v, 10.0)
    # A threshold of 0 lets everything through: the first k indices are kept.
    z = jnp.zeros(n).at[7].set(1.0)
    _, iz = topk.sampled_topk(z, k, key, sample_ratio=0.01, implementation="xla")
    np.testing.assert_array_equal(iz, np.arange(k))
    with pytest.raises(ValueError, match="sample_ratio"):
      topk.sampled_topk(x, k, key, sample_ratio=0.0)


class TestKernelsInterpret(TestKernelsCompiled):
  """The same cases in interpret mode (``interpret=True``), on any backend."""

  INTERPRET = True


@pytest.mark.parametrize("workers", [3, 5])
def test_persistent_grid_block_order_gives_the_same_bits(workers):
  """The GPU path runs more blocks than SMs on a persistent grid (worker w's
  step i takes block min(w + i * workers, last), the last block repeated
  past the end); interpret mode runs that order with a few workers
  (``interpret=Interpret(workers=w)``). Every kernel's outputs, the seeded
  dither (which hashes the block's element index) included, equal the plain
  grid's bit for bit."""
  n = 16384 * 7 + 77  # 8 blocks of 64 blocks of 256 (57 of 64 rows): several steps a worker
  x = _normal(n, jnp.float32, seed=3)
  seed = jnp.array([5, 9], jnp.uint32)
  runs = {
      "sign": lambda i: sign.sign_pack(x, config=QCFG, interpret=i),
      "qsgd": lambda i: qsgd.qsgd_quantize(x, levels=7, bucket_size=128, seed=seed,
                                               config=QCFG, interpret=i),
      "int8": lambda i: int8_block.int8_block_quantize(x, block_size=256, seed=seed,
                                                     config=QCFG, interpret=i),
      "fp8": lambda i: fp8_block.fp8_block_quantize(x, block_size=128, format="e5m2",
                                                   seed=seed, config=QCFG, interpret=i),
      "qsgd_2bit": lambda i: qsgd.qsgd_quantize(
          x, levels=1, bucket_size=32, seed=seed, config=QCFG, interpret=i),
      "topk": lambda i: topk.topk(x, 100, config=TCFG, interpret=i),
  }
  plain = {k: jax.tree.map(np.asarray, f(True)) for k, f in runs.items()}
  assert _launch.persistent_grid(8, workers).steps == -(-8 // workers)  # repeats at the end
  persistent = _launch.Interpret(workers=workers)
  for k, f in runs.items():
    for a, b in zip(jax.tree.leaves(plain[k]), jax.tree.leaves(f(persistent))):
      np.testing.assert_array_equal(a, np.asarray(b), err_msg=k)
