"""Structure of the XLA paths: how many passes over the gradient each
compressor's update makes (jaxcomp.hlo.traffic.memory_passes on the compiled CPU
module), and that no path draws n-sized random numbers through jax.random.

A pass is ``4 n`` bytes of gradient-sized buffers read or written. The
budgets below are the counts of the lean paths, each explained; a change that
adds a pass (a padded copy, a materialised intermediate, a dense decode of a
sparse payload) fails here before it shows in
``benchmarks/transform_overhead.py``.
"""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp.hlo import traffic as hlo
from jaxcomp.cli import parse_compressor_spec
from jaxcomp.compressors.base import get

from tests.helpers import sharded_update, stacked

SHAPES = [(512, 1024), (1024,), (1024, 256), (256,)]
N = sum(int(np.prod(s)) for s in SHAPES)

# Every update below (error feedback on where the compressor is biased):
#   identity: concatenation (read + write), psum (a copy on one device, 2),
#     split into the leaves (2) = 6.
# Error-feedback compressors first add the residual (read g and e, write v:
# 3) and concatenate v (2); their residual norm statistic reads once (1).
#   sparse (top-k, DGC, threshold): + one packed mask pass over the bucket
#     (1) + the mean's per-part zeros (1) = 8; what was sent is scattered
#     into the residual in place.
#   sign: + scale and packing (2) + residual v - decode (read v, write: 2)
#     + the mean written (1) = 11.
#   int8 block: as sign, with the block scales' reduction and 8-bit codes
#     read back (0.25 each way) = 12.75; int4 packs in the same pass = 11.
#   fp8 block: the scaled values are written before the fp8 cast (2 more):
#     15.
# Unbiased compressors keep no residual:
#   QSGD: concatenation (2), norms (1), quantize-and-pack (1), mean (1) = 5.
#   TernGrad: + |x| written for the max (2) = 7 (XLA:CPU's reduction reads a
#     written operand; see docs/codec_speed.md).
#   random-k / random-block: concatenation read where the k entries are
#     gathered (1), EF as above, the mean's zeros (1) = 5.
#   PowerSGD (rank 1): EF add (3), M read by M Q and by M^T P (2), P Q^T
#     written (1), residual (2), norm (1) = 9.
BUDGET = {
    "identity": 6.0, "qsgd": 5.0, "terngrad": 7.0, "sign": 11.0,
    "int8_block": 12.75, "int8_block:bits=4": 11.0, "fp8_block": 15.0,
    "topk": 8.0, "dgc": 8.0, "threshold": 8.0, "random_k": 5.0,
    "random_block": 5.0, "powersgd": 9.0,
}


def _update_passes(spec: str) -> hlo.MemoryPasses:
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  params = [jnp.zeros(s, jnp.float32) for s in SHAPES]
  grads = stacked([jnp.ones((1,) + s, jnp.float32) for s in SHAPES], mesh)
  name, kw = parse_compressor_spec(spec)
  tx = jaxcomp.compressed_mean(name, "data", nonfinite="zero",
                               bucketing="whole", **kw)
  f, state, _ = sharded_update(tx, params, mesh)
  return hlo.memory_passes(f.lower(grads, state).compile(), N // 4)


@pytest.mark.parametrize("spec", sorted(BUDGET))
def test_update_passes_within_budget(spec):
  mp = _update_passes(spec)
  passes = mp.passes(4 * N)
  assert passes <= BUDGET[spec] + 0.05, (
      f"{spec}: {passes:.2f} passes over the gradient, budget "
      f"{BUDGET[spec]}\n{mp.table()}")


def test_sparse_fallbacks_are_branches_not_every_step():
  """Top-k's exact fallback (a sort of the whole bucket) and DGC's halving
  loop sit in conditional branches: counted apart, not on every step."""
  for spec in ("topk", "dgc"):
    mp = _update_passes(spec)
    assert mp.branch_passes(4 * N) > 1.0, spec
    assert not any(op.opcode == "sort" and not op.in_branch for op in mp.ops)


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


@pytest.mark.parametrize("name,kw", [
    ("qsgd", {}), ("terngrad", {}), ("random_k", {}),
    ("int8_block", {"rounding": "stochastic"}),
    ("int8_block", {"rounding": "stochastic", "bits": 4}),
    ("fp8_block", {"rounding": "stochastic"}), ("dgc", {})])
def test_no_gradient_sized_random_bits(name, kw):
  """Random numbers come from the counter hash (jaxcomp.kernels.dither), fused
  where they are used: jax.random draws only a few words of seed."""
  comp = get(name, **kw)
  n = 100_000
  closed = jax.make_jaxpr(lambda x, k: comp.encode(x, k))(
      jnp.ones((n,), jnp.float32), jax.random.key(0))
  drawn = [v.aval.size for e in _eqns(closed.jaxpr)
           if "random" in e.primitive.name or "threefry" in e.primitive.name
           for v in e.outvars]
  assert drawn and max(drawn) < n // 10, (name, drawn)


def test_memory_passes_counts_a_simple_module():
  n = 1 << 20
  x = jnp.ones((n,), jnp.float32)
  scale = hlo.memory_passes(jax.jit(lambda v: v * 2).lower(x).compile(),
                            n // 4)
  assert (scale.read_bytes, scale.write_bytes) == (4 * n, 4 * n)
  total = hlo.memory_passes(jax.jit(jnp.sum).lower(x).compile(), n // 4)
  assert (total.read_bytes, total.write_bytes) == (4 * n, 0)
  # a gather of 10 elements reads what it selects, not the whole array
  pick = hlo.memory_passes(
      jax.jit(lambda v: v[jnp.arange(10) * 7]).lower(x).compile(), n // 4)
  assert pick.read_bytes < 1000
  # an in-place update writes its update only
  upd = hlo.memory_passes(jax.jit(
      lambda v: jax.lax.dynamic_update_slice(v, jnp.zeros((8,)), (3,)),
      donate_argnums=0).lower(x).compile(), n // 4)
  assert upd.write_bytes < 1000
  # work inside a conditional branch is reported apart
  cond = hlo.memory_passes(jax.jit(lambda v, b: jax.lax.cond(
      b, lambda: jnp.sort(v), lambda: v)).lower(x, True).compile(), n // 4)
  assert cond.branch_passes(4 * n) >= 2


@pytest.mark.parametrize("sizes", [(300, 1, 699), tuple([50] * 20)])
def test_sparse_parts_equal_the_dense_decode_bit_for_bit(sizes):
  """What a sparse local does to the residual equals subtracting its dense
  decode, to the bit, with repeated positions (slots padded at index 0),
  a part of one element, and buckets of few parts (one scatter per part) or
  many (one scatter into the concatenation)."""
  from jaxcomp import _parts
  n = sum(sizes)
  rng = np.random.default_rng(0)
  idx = np.concatenate([rng.choice(n, 60, replace=False), [0, 0, 0]])
  vals = np.concatenate([rng.normal(size=60), [0.0, 0.0, 0.0]])
  sparse = _parts.SparseParts(jnp.asarray(idx, jnp.int32),
                              jnp.asarray(vals, jnp.float32), sizes)
  v = _parts.split(jnp.asarray(rng.normal(size=n), jnp.float32), sizes)
  dense = jnp.zeros((n,), jnp.float32).at[idx].add(jnp.asarray(vals, jnp.float32))
  want = _parts.concat(v) - dense
  got = _parts.concat(_parts.sub(v, sparse))
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                np.asarray(want).view(np.uint32))
  np.testing.assert_array_equal(_parts.concat(sparse.dense()), dense)
  assert len(sparse) == len(sizes)
