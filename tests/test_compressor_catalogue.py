"""Every registered compressor: wire bytes read from the HLO equal its
payload formula on all devices (8 simulated CPU devices in CI, the GPUs on a
GPU machine), and float32 / bfloat16 / float16 gradients come back in their
own dtype."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp import collectives
from tests.helpers import sharded_update, stacked

# Small hyperparameters so that every compressor really compresses the test
# leaves (and PowerSGD's min_compression_rate lets them through).
KWARGS = {
    "topk": dict(ratio=0.05), "random_block": dict(ratio=0.05),
    "random_k": dict(ratio=0.05), "dgc": dict(ratio=0.05),
    "threshold": dict(threshold=0.5, capacity_ratio=0.1),
    "powersgd": dict(rank=2), "int8_block": dict(block_size=64),
    "fp8_block": dict(block_size=64), "qsgd": dict(levels=4, bucket_size=64),
}
# Payload values travel in the gradient's own dtype. On CPU, XLA widens
# 16-bit float all-reduces and bfloat16 all-gathers to float32 in the
# compiled module (GPUs move them natively), so the lowered module, what the
# program asks for, is read.
SHAPES = {"w": ((48, 64), jnp.float32), "b": ((32, 32), jnp.bfloat16),
          "h": ((20, 32), jnp.float16)}


def _build(mesh, name):
  comp = jaxcomp.compressors.get(name, **KWARGS.get(name, {}))
  tx = jaxcomp.compressed_mean(comp, "data", nonfinite="zero")
  params = {k: jnp.zeros(s, d) for k, (s, d) in SHAPES.items()}
  f, state, _ = sharded_update(tx, params, mesh)
  rng = np.random.default_rng(0)
  grads = stacked({k: jnp.asarray(rng.normal(size=(mesh.size,) + s), d)
                   for k, (s, d) in SHAPES.items()}, mesh)
  return comp, f, grads, state


@pytest.mark.parametrize("name", jaxcomp.compressors.names())
def test_hlo_bytes_equal_payload_formula_and_dtypes_survive(mesh_all, name):
  comp, f, grads, state = _build(mesh_all, name)
  lowered = f.lower(grads, state)
  traffic = jaxcomp.collective_traffic(lowered)
  coll = collectives.get(None, comp)
  expected = sum(coll.payload_bytes(comp, (s,), {"data": mesh_all.size}, d)
                 for s, d in SHAPES.values())
  assert traffic.operand_bytes == expected, traffic.table()
  if name not in ("identity", "cast"):
    dense = 4 * sum(int(np.prod(s)) for s, _ in SHAPES.values())
    assert traffic.operand_bytes < dense  # it really compresses

  updates, _ = f(grads, state)
  for k, (shape, dtype) in SHAPES.items():
    assert updates[k].dtype == dtype and updates[k].shape == shape
    assert bool(jnp.all(jnp.isfinite(updates[k].astype(jnp.float32))))
    # The update moves the parameters the gradient's way on average.
    ref = jnp.mean(grads[k].astype(jnp.float32), axis=0)
    assert float(jnp.vdot(updates[k].astype(jnp.float32), ref)) > 0


def test_registry_has_one_name_per_compressor():
  classes = {}
  for name in jaxcomp.compressors.names():
    cls = type(jaxcomp.compressors.get(name))
    assert cls.name == name
    classes.setdefault(cls, []).append(name)
  assert all(len(v) == 1 for v in classes.values()), classes
  for name in ("sign", "majority_vote", "onebit", "terngrad", "int8_block",
               "fp8_block", "random_k", "threshold", "dgc", "powersgd"):
    assert name in jaxcomp.compressors.names()
  assert {"ef21", "dgc"} <= set(jaxcomp.feedback.names())
