"""jaxcomp.zero_one_adam against an independent NumPy transcription of 0/1
Adam (Lu et al. 2023, as DeepSpeed's ``ZeroOneAdam`` runs it: variance
updates at doubling intervals with 1-bit gradient exchanges between them,
then frozen variance, local steps and 1-bit synchronisations at doubling
intervals up to the clipper), on 8 devices, one copy of the parameters
per device (``jaxcomp.Islands``), over steps that cross the freeze and
include skipped rounds; its Orbax resume mid-interval."""

import dataclasses

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
P_ = 8


def reference_zero_one_adam(params, grads, *, var_freeze_step,
                            var_update_scaler, local_step_scaler,
                            local_step_clipper, lr, b1, b2, eps, weight_decay):
  """DeepSpeed's ZeroOneAdam.step on 8 ranks, each with its own parameters
  (its set-up call left out: ``step`` counts training steps, and the
  variance freezes after step ``var_freeze_step``). ``grads``: per step,
  per leaf (8, *shape): rank r's own gradient."""
  p = P_
  keys = sorted(params)
  x = {k: np.repeat(params[k][None].astype(np.float64), p, 0) for k in keys}
  m = {k: np.zeros(x[k].shape) for k in keys}
  v = {k: np.zeros(params[k].shape) for k in keys}
  u = {k: np.zeros(x[k].shape) for k in keys}
  n = {k: params[k].size for k in keys}
  worker = {k: np.zeros((p, ds_padded(n[k], p))) for k in keys}
  server = {k: np.zeros((p, ds_padded(n[k], p) // p)) for k in keys}
  lrs = {k: 0.0 for k in keys}
  var_interval, var_counter, local_interval, local_counter = 1, 0, 1, 0
  dense = compressed = 0
  for t, g in enumerate(grads):
    step = t + 1
    frozen = step > var_freeze_step
    if step == var_freeze_step + 1:  # reinitial_error_buffer
      for k in keys:
        worker[k][:] = 0
        server[k][:] = 0
    var_step = not frozen and step % var_interval == 0
    sync = frozen and step % local_interval == 0
    dense += var_step
    compressed += (not frozen and not var_step) or sync
    for k in keys:
      gk = g[k].astype(np.float64)
      if not frozen:
        if var_step:  # the engine's all-reduce ran for this step
          mean = gk.mean(0)
          v[k] = b2 * v[k] + (1 - b2) * mean * mean
          m[k] = b1 * m[k] + (1 - b1) * mean[None]
        else:
          onebit = ds_compressed_allreduce(
              gk.reshape(p, -1), worker[k], server[k]).reshape(v[k].shape)
          m[k] = b1 * m[k] + (1 - b1) * onebit[None]
      else:
        m[k] = b1 * m[k] + (1 - b1) * gk
        lrs[k] += lr
      update = m[k] / (np.sqrt(v[k]) + eps) + weight_decay * x[k]
      x[k] = x[k] - lr * update
      if frozen:
        u[k] = u[k] - lr * update
      if sync:
        x[k] = x[k] - u[k]
        u[k] = u[k] * (np.sqrt(v[k]) + eps)
        avg = ds_compressed_allreduce(u[k].reshape(p, -1), worker[k],
                                      server[k]).reshape(v[k].shape)
        m[k] = np.repeat((-avg / lrs[k])[None], p, 0)
        x[k] = x[k] + avg / (np.sqrt(v[k]) + eps)
        u[k][:] = 0
        lrs[k] = 0.0
    if not frozen:
      if var_step:
        var_counter += 1
        if var_counter == var_update_scaler:
          var_counter, var_interval = 0, var_interval * 2
    else:
      local_counter += 1
      if local_counter == local_step_scaler:
        local_counter = 0
        local_interval = min(local_step_clipper, local_interval * 2)
  return dict(x=x, m=m, v=v, u=u, worker=worker, server=server,
              var_interval=var_interval, local_interval=local_interval,
              dense=dense, compressed=compressed)


def _loss(p, g):
  """A loss whose gradient on each device is the gradient given to it."""
  return sum(jnp.vdot(p[k], g[k][0]) for k in p)


def _grads(steps, seed=0):
  rng = np.random.default_rng(seed)
  return [{k: (rng.normal(size=(P_,) + s) * rng.uniform(0.1, 2.0, (P_,) + (1,) * len(s))
               ).astype(np.float32) for k, s in SHAPES.items()}
          for _ in range(steps)]


def _params(seed=1):
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


HP = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=2,
          local_step_clipper=4)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_zero_one_adam_is_the_papers_algorithm(mesh8, weight_decay):
  """16 steps: variance steps 1, 2, 4, 6 (dense), 1-bit gradients at 3 and
  5, then syncs at 7, 8, 10, 12, 16 and skipped rounds at 9, 11, 13-15
  (the local interval doubling to the clipper, 4)."""
  hp = dict(HP, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)
  tx = jaxcomp.zero_one_adam(hp.pop("lr"), axis_name="data", **{
      k: v for k, v in hp.items() if k != "lr"})
  params, grads = _params(), _grads(16)
  islands = jaxcomp.Islands()
  state = jaxcomp.init(tx, jax.tree.map(jnp.asarray, params), mesh8,
                       layout=islands)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh8, layout=islands)
  history = []
  for g in grads:
    state, _ = step(state, jax.device_put(g, NamedSharding(mesh8, P("data"))))
    history.append(np.asarray(state.params["w"]))
  ref = reference_zero_one_adam(params, grads, lr=1e-2, **hp)
  st = state.opt_state
  # 1e-6 relative to each leaf's size (float32 steps of O(1) parameters
  # leave absolute errors of about 1e-7, which a small element shows as a
  # larger relative one).
  close = lambda got, want: np.testing.assert_allclose(
      np.asarray(got), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
  for i, k in enumerate(sorted(SHAPES)):
    close(state.params[k], ref["x"][k])
    close(st.mu[k], ref["m"][k])
    np.testing.assert_allclose(np.asarray(st.nu[k]), ref["v"][k], rtol=1e-6,
                               atol=1e-12)
    scale = np.abs(ref["worker"][k]).max()
    np.testing.assert_allclose(np.asarray(st.worker_error[i]),
                               ref["worker"][k], rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(np.asarray(st.server_error[i]),
                               ref["server"][k], rtol=0, atol=1e-5 * scale)
    # Step 16 synchronised: every device holds the anchor exactly.
    for d in range(P_):
      np.testing.assert_array_equal(np.asarray(state.params[k])[d],
                                    np.asarray(st.anchor[k]))
  assert int(st.local_interval) == ref["local_interval"] == 4
  assert int(st.var_interval) == ref["var_interval"] == 4
  # Between syncs the devices' parameters differ (local steps) ...
  assert np.abs(history[14][0] - history[14][1]).max() > 0
  # ... and a sync makes them one again.
  assert np.abs(history[11][0] - history[11][1]).max() == 0
  t = jaxcomp.get_stats(st)
  assert (t.dense_steps, t.compressed_steps) == (ref["dense"],
                                                 ref["compressed"]) == (4, 7)
  assert t.silent_steps == 16 - 4 - 7  # local steps between syncs
  assert t.dense_total_bytes == 16 * t.dense_bytes_per_exchange
  # The performance model's schedule and bytes for the same run.
  priced = perfmodel.optimizer_traffic(
      perfmodel.CompressedOptimizer(
          "zero_one_adam", steps=16, freeze_step=HP["var_freeze_step"],
          **{k: v for k, v in HP.items() if k != "var_freeze_step"}),
      [int(np.prod(SHAPES[k])) for k in sorted(SHAPES)], P_)
  assert priced._asdict() == pytest.approx(t._asdict())


def test_zero_one_adam_resumes_from_orbax_bit_for_bit(mesh8, tmp_path):
  pytest.importorskip("orbax.checkpoint")
  tx = jaxcomp.zero_one_adam(1e-2, axis_name="data", **HP)
  islands = jaxcomp.Islands()
  grads = [jax.device_put(g, NamedSharding(mesh8, P("data")))
           for g in _grads(12, seed=4)]
  params = jax.tree.map(jnp.asarray, _params())
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh8, layout=islands,
                                 donate=False)
  state = jaxcomp.init(tx, params, mesh8, layout=islands)
  cut = 9  # a skipped round: local steps pending, the errors live
  for g in grads[:cut]:
    state, _ = step(state, g)
  assert np.abs(np.asarray(state.opt_state.accumulator["w"])).max() > 0
  ckpt = jaxcomp.checkpoint.Checkpointer(tmp_path)
  ckpt.save(cut, {"params": state.params, "opt_state": state.opt_state})
  a = state
  for g in grads[cut:]:
    a, _ = step(a, g)
  fresh = jaxcomp.init(tx, params, mesh8, layout=islands)
  _, restored = ckpt.restore({"params": fresh.params,
                              "opt_state": fresh.opt_state})
  r = dataclasses.replace(fresh, params=restored["params"],
                          opt_state=restored["opt_state"])
  for g in grads[cut:]:
    r, _ = step(r, g)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(r)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_zero_one_adam_needs_one_copy_per_device(mesh8):
  tx = jaxcomp.zero_one_adam(1e-2, axis_name="data", var_freeze_step=4)
  with pytest.raises(ValueError, match=r"zero_one_adam.*layout=jaxcomp\.Islands"):
    jaxcomp.init(tx, jax.tree.map(jnp.asarray, _params()), mesh8)


@pytest.mark.parametrize("kwargs,name", [
    (dict(var_freeze_step=0), "var_freeze_step"),
    (dict(var_update_scaler=0), "var_update_scaler"),
    (dict(local_step_scaler=1.5), "local_step_scaler"),
    (dict(local_step_clipper=-1), "local_step_clipper"),
    (dict(eps=-1.0), "eps"),
])
def test_zero_one_adam_refuses_bad_arguments_at_construction(kwargs, name):
  kwargs = {"axis_name": "data", "var_freeze_step": 4, **kwargs}
  with pytest.raises(ValueError, match=name):
    jaxcomp.zero_one_adam(1e-3, **kwargs)


def test_zero_one_adam_stats_are_what_the_compiled_step_sends(mesh8):
  """The variance steps' all-reduces are the state's dense bytes; the
  1-bit exchange, of the gradient before the freeze and of the
  accumulated steps at a sync after it (two branches of the compiled
  step), its compressed bytes each."""
  tx = jaxcomp.zero_one_adam(1e-3, axis_name="data", **HP)
  islands = jaxcomp.Islands()
  state = jaxcomp.init(tx, jax.tree.map(jnp.asarray, _params()), mesh8,
                       layout=islands)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh8, layout=islands)
  batch = jax.device_put(_grads(1)[0], NamedSharding(mesh8, P("data")))
  ops = jaxcomp.collective_traffic(step.lower(state, batch).compile()).ops
  branch = [o for o in ops if o.in_branch]
  dense = sum(o.operand_bytes for o in branch if o.kind == "all-reduce")
  onebit = sum(o.operand_bytes for o in branch
               if o.kind in ("all-to-all", "all-gather"))
  stats = state.opt_state.stats
  assert dense == float(stats.dense_bytes)
  assert onebit == 2 * float(stats.compressed_bytes)
