"""The compressors' kernel path against their XLA path on the backend at hand.

On an NVIDIA GPU a compressor built with ``implementation="pallas"`` runs the
compiled Mosaic GPU kernels; with ``implementation="xla"`` the pure-``jnp``
reference. Their wire payloads must be identical bit for bit (the kernels'
contract, see ``jaxcomp.kernels``), except float sums: the sign scale and
QSGD's norms (computed inside the one-pass kernel) may differ in their last
bits by summation order, and QSGD's codes are then those of the reference
under the kernel's own norms. A whole ``compressed_mean`` update must be the
same through either path (up to those last bits for sign and QSGD). Off GPU the
kernels only run in interpret mode (``tests/test_kernels.py``), so this file
is skipped there.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from tests.helpers import sharded_update, stacked

pytestmark = pytest.mark.skipif(
    not jaxcomp.kernels.nvidia_gpu(),
    reason="the Pallas kernels compile only on an NVIDIA GPU backend")

CASES = {
    "topk": dict(ratio=0.01),
    "qsgd": dict(levels=15, bucket_size=512),
    "sign": {},
    "int8_block": dict(block_size=256),
}
SIZES = (4096, 100_003, 2_000_000)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("n", SIZES)
def test_pallas_payload_equals_xla_payload(name, n):
  x = jax.random.normal(jax.random.key(n), (n,), jnp.float32)
  key = jax.random.key(7)
  got = jax.jit(jaxcomp.compressors.get(
      name, implementation="pallas", **CASES[name]).encode)(x, key)
  want = jax.jit(jaxcomp.compressors.get(
      name, implementation="xla", **CASES[name]).encode)(x, key)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  if name == "qsgd":  # codes consistent with the kernel's own norms
    want = dict(want, codes=jaxcomp.kernels.qsgd.qsgd_codes_reference(
        x, got["norms"], levels=CASES[name]["levels"],
        bucket_size=CASES[name]["bucket_size"],
        seed=jaxcomp.kernels.dither.seed_of(key)))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.shape == w.shape and g.dtype == w.dtype
    if name in ("sign", "qsgd") and jnp.issubdtype(g.dtype, jnp.floating):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
    else:
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("name", sorted(CASES))
def test_compressed_mean_same_through_either_path(name):
  mesh = jax.make_mesh((1,), ("data",))
  params = {"w": jnp.zeros((512, 1000)), "b": jnp.zeros((1000,))}
  grads = jax.tree.map(
      lambda p: jax.random.normal(jax.random.key(p.size), p.shape), params)
  outs = []
  for impl in ("pallas", "xla"):
    tx = jaxcomp.compressed_mean(name, "data", implementation=impl,
                                 min_compress_size=0, **CASES[name])
    f, state, _ = sharded_update(tx, params, mesh)
    g = stacked(jax.tree.map(lambda x: x[None], grads), mesh)
    u1, state = f(g, state)
    u2, state = f(g, state)  # error feedback from step 1 is used
    outs.append((u1, u2))
  for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
    if name == "sign":  # the scale's summation order
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    elif name == "qsgd":  # norms' last bits; a code may move by one level
      step = 2 * float(jnp.max(jnp.abs(b))) / CASES[name]["levels"] + 1e-6
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=step)
    else:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

