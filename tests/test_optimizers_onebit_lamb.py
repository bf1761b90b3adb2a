"""jaxcomp.onebit_lamb against an independent NumPy transcription of 1-bit
LAMB (Li et al. 2022, as DeepSpeed's ``OnebitLamb`` runs it: warm-up LAMB
with running trust ratios, then scaled momenta fused into one 1-bit
all-reduce and the frozen coefficient times a bounded factor), on 8
devices, across the freeze step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomp
from jaxcomp import perfmodel
from tests.test_optimizers_onebit_adam import ds_compressed_allreduce
from tests.test_optimizers_onebit_adam import ds_padded

SHAPES = {"b": (5,), "w": (12, 10), "z": (40, 33)}


def reference_onebit_lamb(params, grads, *, freeze_step, lr, b1, b2, eps,
                          weight_decay, max_coeff=10.0, min_coeff=0.01,
                          coeff_beta=0.9, factor_max=4.0, factor_min=0.5,
                          factor_threshold=0.1):
  """DeepSpeed's OnebitLamb.step on p ranks (its set-up call left out: the
  step counter here counts training steps). ``grads``: per step, per leaf
  (p, *shape). Layers in sorted-key order (jax.tree.leaves')."""
  keys = sorted(params)
  p = grads[0][keys[0]].shape[0]
  x = {k: params[k].astype(np.float64) for k in keys}
  m = {k: np.zeros(x[k].shape) for k in keys}
  v = {k: np.zeros(x[k].shape) for k in keys}
  v_fresh = {k: np.zeros(x[k].shape) for k in keys}
  coeff_freeze = {k: 0.0 for k in keys}
  last_factor = {k: 1.0 for k in keys}
  scaling = {}
  total = sum(x[k].size for k in keys)
  worker = np.zeros((p, ds_padded(total, p)))
  server = np.zeros((p, ds_padded(total, p) // p))
  for t, g in enumerate(grads):
    step = t + 1
    if step <= freeze_step:  # warm-up: baseline LAMB on the mean gradient
      for k in keys:
        mean = g[k].astype(np.float64).mean(0)
        m[k] = b1 * m[k] + (1 - b1) * mean
        v[k] = b2 * v[k] + (1 - b2) * mean * mean
        if step == freeze_step:
          v_fresh[k] = v[k].copy()
        weight_norm = np.sqrt((x[k] ** 2).sum())
        update = m[k] / (np.sqrt(v[k]) + eps)
        if weight_decay > 0:
          update = update + weight_decay * x[k]
        update_norm = np.sqrt((update ** 2).sum())
        lamb_coeff = 1.0
        if weight_norm != 0 and update_norm != 0:
          lamb_coeff = min(max(weight_norm / update_norm, min_coeff), max_coeff)
        if lamb_coeff != 1.0:
          coeff_freeze[k] = (coeff_beta * coeff_freeze[k]
                             + (1 - coeff_beta) * lamb_coeff)
        x[k] = x[k] - lr * lamb_coeff * update
      continue
    last = {k: m[k].copy() for k in keys}
    if not scaling:  # the first compression step
      scales = {k: np.linalg.norm(m[k]) / np.sqrt(m[k].size) for k in keys}
      united = sum(scales.values()) / len(scales)
      scaling = {k: united / scales[k] for k in keys}
    local = np.concatenate([
        ((b1 * m[k][None] + (1 - b1) * g[k].astype(np.float64))
         * scaling[k]).reshape(p, -1) for k in keys], axis=1)
    flat = ds_compressed_allreduce(local, worker, server)
    at = 0
    for k in keys:
      m[k] = flat[at:at + x[k].size].reshape(x[k].shape) / scaling[k]
      at += x[k].size
      grad_reconstruct = (m[k] - last[k] * b1) / (1 - b1)
      v_fresh[k] = b2 * v_fresh[k] + (1 - b2) * grad_reconstruct ** 2
      denom = np.sqrt(v[k]) + eps
      update_prelim = m[k] / denom
      update = (update_prelim + weight_decay * x[k] if weight_decay > 0
                else update_prelim)
      update_norm = np.sqrt((update ** 2).sum())
      denom_real = np.sqrt(v_fresh[k]) + eps
      factor = (denom / denom_real).max()
      if weight_decay > 0:
        ratio = min(1.0, np.sqrt((update_prelim ** 2).sum()) / update_norm)
        factor = factor * ratio + (1.0 - ratio)
      factor = min(max(factor, factor_min), factor_max)
      factor = min(factor, last_factor[k] * (1.0 + factor_threshold))
      factor = max(factor, last_factor[k] * (1.0 - factor_threshold))
      last_factor[k] = factor
      x[k] = x[k] - lr * coeff_freeze[k] * factor * update
  return x, m, v, v_fresh, coeff_freeze, last_factor, worker, server


def _loss(p, g):
  return sum(jnp.vdot(p[k], g[k][0]) for k in p)


def _grads(steps, seed=0):
  rng = np.random.default_rng(seed)
  return [{k: (rng.normal(size=(8,) + s) * rng.uniform(0.1, 2.0, (8,) + (1,) * len(s))
               ).astype(np.float32) for k, s in SHAPES.items()}
          for _ in range(steps)]


@pytest.mark.parametrize("freeze_step,steps,weight_decay",
                         [(3, 9, 0.0), (4, 8, 0.01)])
def test_onebit_lamb_is_the_papers_algorithm(mesh8, freeze_step, steps,
                                             weight_decay):
  hp = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)
  tx = jaxcomp.onebit_lamb(hp["lr"], axis_name="data", freeze_step=freeze_step,
                           b1=hp["b1"], b2=hp["b2"], eps=hp["eps"],
                           weight_decay=weight_decay)
  rng = np.random.default_rng(11)
  params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
  grads = _grads(steps, seed=freeze_step)
  state = jaxcomp.init(tx, jax.tree.map(jnp.asarray, params), mesh8)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh8)
  for g in grads:
    state, _ = step(state, jax.device_put(g, NamedSharding(mesh8, P("data"))))
  x, m, v, v_fresh, coeff_freeze, last_factor, worker, server = (
      reference_onebit_lamb(params, grads, freeze_step=freeze_step, **hp))
  st = state.opt_state
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(state.params[k]), x[k], rtol=1e-6,
                               atol=1e-7)
    np.testing.assert_allclose(np.asarray(st.mu[k]), m[k], rtol=1e-6,
                               atol=1e-7)
    np.testing.assert_allclose(np.asarray(st.nu[k]), v[k], rtol=1e-6,
                               atol=1e-12)
    np.testing.assert_allclose(np.asarray(st.nu_fresh[k]), v_fresh[k],
                               rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(float(st.coeff_freeze[k]), coeff_freeze[k],
                               rtol=1e-6)
    np.testing.assert_allclose(float(st.last_factor[k]), last_factor[k],
                               rtol=1e-6)
  scale = np.abs(worker).max()
  np.testing.assert_allclose(np.asarray(st.worker_error[0]), worker, rtol=0,
                             atol=1e-5 * scale)
  np.testing.assert_allclose(np.asarray(st.server_error[0]), server, rtol=0,
                             atol=1e-5 * scale)
  t = jaxcomp.get_stats(st)
  assert (t.dense_steps, t.compressed_steps) == (freeze_step,
                                                 steps - freeze_step)
  # One fused buffer: one scale per exchange phase, 8 chunks of signs.
  words = -(-ds_padded(sum(int(np.prod(s)) for s in SHAPES.values()), 8)
            // 8 // 32)
  assert t.compressed_bytes_per_exchange == 4 * 8 * words + 4 * words + 8
  priced = perfmodel.optimizer_traffic(
      perfmodel.CompressedOptimizer("onebit_lamb", steps=steps,
                                    freeze_step=freeze_step),
      [int(np.prod(SHAPES[k])) for k in sorted(SHAPES)], 8)
  assert priced._asdict() == pytest.approx(t._asdict())


@pytest.mark.parametrize("kwargs,name", [
    (dict(freeze_step=0), "freeze_step"),
    (dict(min_coeff=0.0), "min_coeff"),
    (dict(max_coeff=0.001), "max_coeff"),
    (dict(coeff_beta=1.0), "coeff_beta"),
    (dict(factor_min=1.5), "factor_min"),
    (dict(factor_max=0.5), "factor_max"),
    (dict(factor_threshold=-0.1), "factor_threshold"),
    (dict(b1=2.0), "b1"),
])
def test_onebit_lamb_refuses_bad_arguments_at_construction(kwargs, name):
  kwargs = {"axis_name": "data", "freeze_step": 2, **kwargs}
  with pytest.raises(ValueError, match=name):
    jaxcomp.onebit_lamb(1e-3, **kwargs)
