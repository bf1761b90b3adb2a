"""The elastic islands' outer sync (jaxcomp.elastic._outer) is lowcomm's
DiLoCo: on the same pseudo-gradients, compressor and outer optimizer they
reach the same anchor and residual. Runs without torch: the islands' JAX
numerics import no torch, and neither does ``import jaxcomp.elastic``."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
import pytest

import jaxcomp
from jaxcomp import compressors
from jaxcomp import lowcomm
from jaxcomp.elastic import _outer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"b": (16,), "w": (8, 8)}  # 80 elements, one buffer


def _loss(p, batch):
  # The gradient of each leaf is this device's batch row: the
  # pseudo-gradient of one inner SGD step of rate 1 is that row.
  return sum(jnp.sum(p[k] * batch[k].reshape(SHAPES[k])) for k in SHAPES)


def _rounds(mesh, n):
  out = []
  p = mesh.shape["data"]
  for r in range(n):
    keys = jax.random.split(jax.random.key(10 + r), len(SHAPES))
    out.append({k: jax.random.normal(kk, (p, *SHAPES[k])) * (r + 1.0)
                for kk, k in zip(keys, SHAPES)})
  return out


OUTERS = {"sgd": lambda: optax.sgd(1.0),
          "nesterov": lambda: optax.sgd(0.7, momentum=0.9, nesterov=True)}


@pytest.mark.parametrize("outer_name", sorted(OUTERS))
@pytest.mark.parametrize("name,kwargs", [("topk", {"ratio": 0.1}),
                                         ("int8_block", {"block_size": 32})])
def test_islands_outer_sync_is_lowcomms_diloco(mesh8, name, kwargs,
                                               outer_name):
  """One DiLoCo: ``jaxcomp.diloco`` over 8 devices (``sync_every=1``, one
  inner SGD step of rate 1, the buffer whole and all-gathered, residual
  error feedback) and 8 elastic islands running the islands' encode,
  rank-order decode-mean and outer step on the same interval end points
  reach the same anchor, and the same residual per island and device,
  over three syncs: the two share the pseudo-gradient and outer step
  (jaxcomp.lowcomm), the residual (jaxcomp.feedback) and the decode-sum
  (the compressor's), the same float32 operations in the same order.

  With plain SGD as the outer optimizer they agree bit for bit. With
  DiLoCo's Nesterov SGD an anchor entry may differ by a float32 ulp or
  so: the same operations are compiled by XLA in two programs (lowcomm's
  outer step fused inside the sync's ``lax.cond`` of its ``shard_map``,
  the island's alone in its own ``jit``), and the momentum's
  multiply-adds round differently in them; residuals then follow
  within the same rounding."""
  outer = OUTERS[outer_name]()
  inner = optax.sgd(1.0)
  params = {k: jax.random.normal(jax.random.key(i), s) * 0.5
            for i, (k, s) in enumerate(SHAPES.items())}
  tx = jaxcomp.diloco(inner, outer, sync_every=1, compressor=name,
                      collective="allgather", bucketing="whole",
                      error_feedback=True, **kwargs)
  state = jaxcomp.init(tx, params, mesh8, layout=jaxcomp.Islands())
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh8, layout=jaxcomp.Islands())

  comp = compressors.get(name, **kwargs)
  fb = _outer.feedback_for(True)
  key = jax.random.key(0)
  plan = _outer.plan_buffer(params, comp, key)
  encode, decode_mean, apply_mean = _outer.jitted(plan, comp, fb, outer)
  p = mesh8.shape["data"]
  anchor, outer_state = params, outer.init(params)
  residuals = [jnp.zeros((plan.n,), jnp.float32) for _ in range(p)]

  same = (np.testing.assert_array_equal if outer_name == "sgd" else
          lambda a, b, err_msg: np.testing.assert_allclose(
              a, b, rtol=1e-6, atol=1e-6, err_msg=err_msg))
  for grads in _rounds(mesh8, 3):
    batch = jax.device_put(grads, NamedSharding(mesh8, P("data")))
    state, _ = step(state, batch)
    payloads = []
    for d in range(p):
      g = {k: grads[k][d] for k in SHAPES}
      u, _ = inner.update(g, inner.init(anchor), anchor)
      island_local = optax.apply_updates(anchor, u)
      payload, residuals[d] = encode(anchor, island_local, residuals[d], key)
      payloads.append(payload)
    stacked = [jnp.stack(a) for a in zip(*payloads)]
    anchor, outer_state = apply_mean(anchor, outer_state,
                                     decode_mean(stacked, key))

    synced = lowcomm.synced_params(state.opt_state)
    parts = state.opt_state.exchange_state[0].feedback[0]  # per leaf, per device
    theirs = np.concatenate([np.asarray(x).reshape(p, -1) for x in parts],
                            axis=1)
    for k in SHAPES:
      same(np.asarray(synced[k]), np.asarray(anchor[k]), err_msg=k)
    same(theirs, np.stack(residuals), err_msg="residual")
  assert any(np.any(np.asarray(r) != 0) for r in residuals)


def test_the_buffer_travels_in_its_leaves_dtype():
  """As a bucket of compressed_mean: bf16 leaves encode a bf16 buffer,
  mixed ones a float32 buffer."""
  comp = compressors.get("int8_block")
  key = jax.random.key(0)
  bf16 = {"a": jnp.zeros((4,), jnp.bfloat16), "b": jnp.zeros((3,), jnp.bfloat16)}
  assert _outer.plan_buffer(bf16, comp, key).dtype == jnp.bfloat16
  mixed = {**bf16, "c": jnp.zeros((2,), jnp.float32)}
  plan = _outer.plan_buffer(mixed, comp, key)
  assert plan.dtype == jnp.float32 and plan.n == 9
  assert plan.sizes == (4, 3, 2)


def test_jaxcomp_imports_without_torch():
  """jaxcomp, jaxcomp.elastic and its launcher import without torch and
  torchft; making a Lighthouse (or an island) says which extra to
  install."""
  code = ("import sys; sys.modules['torch'] = None; "
          "sys.modules['torchft'] = None\n"
          "import jaxcomp, jaxcomp.lowcomm, jaxcomp.launch, jaxcomp.checkpoint\n"
          "import jaxcomp.elastic, jaxcomp.elastic.launcher\n"
          "try:\n  jaxcomp.elastic.lighthouse()\nexcept ImportError as e:\n"
          "  print('ERR', e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT,
                            "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-2000:]
  assert "ERR" in out.stdout and "jaxcomp[elastic]" in out.stdout, out.stdout
