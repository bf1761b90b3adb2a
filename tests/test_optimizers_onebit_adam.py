"""jaxcomp.onebit_adam against an independent NumPy transcription of 1-bit
Adam (Tang et al. 2021, Algorithm 1, as DeepSpeed's ``OnebitAdam`` and
``NcclBackend.compressed_allreduce`` run it), on 8 devices, across the
freeze step; its Orbax resume, its byte counts and its argument checks."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomp
from jaxcomp import optimizers
from jaxcomp import perfmodel

# -- the reference, in float64, written from DeepSpeed's code --------------


def ds_padded(n, p):
  """DeepSpeed's corrected_tensor_size: a multiple of size * divider,
  divider = size * 8 / gcd(size, 8)."""
  unit = p * int(p * 8 / math.gcd(p, 8))
  return n if n % unit == 0 else n + unit - n % unit


def ds_sign(x):
  """``x.sign().add_(1).bool().float().add_(-0.5).mul_(2.0)``: +1 for 0."""
  return (np.sign(x) + 1).astype(bool).astype(np.float64) * 2.0 - 1.0


def ds_compressed_allreduce(bufs, worker, server):
  """One tensor's compressed_allreduce on every rank. ``bufs``: (p, n);
  ``worker``: (p, N), ``server``: (p, N / p), updated in place. Returns
  the (n,) result every rank gets."""
  p, n = bufs.shape
  size = worker.shape[1]
  chunk = size // p
  scales, signs = np.zeros(p), np.zeros((p, size))
  for r in range(p):
    b = np.concatenate([bufs[r], np.zeros(size - n)]) + worker[r]
    scales[r] = np.linalg.norm(b) / np.sqrt(b.size)
    worker[r] = b - scales[r] * ds_sign(b)
    signs[r] = ds_sign(b)
  server_scale, server_sign = np.zeros(p), np.zeros((p, chunk))
  for r in range(p):  # rank r reduces chunk r (all-to-all of signs)
    mine = signs[:, r * chunk:(r + 1) * chunk]
    m = (mine * (scales * (1 / p))[:, None]).sum(0) + server[r]
    server_scale[r] = np.linalg.norm(m) / np.sqrt(m.size)
    server[r] = m - server_scale[r] * ds_sign(m)
    server_sign[r] = ds_sign(m)
  return (server_sign * server_scale[:, None]).reshape(-1)[:n]


def reference_onebit_adam(params, grads, *, freeze_step, lr, b1, b2, eps,
                          weight_decay):
  """1-bit Adam on p ranks. ``grads``: per step, per leaf (p, *shape).
  Returns params, exp_avg, exp_avg_sq, worker and server errors."""
  p = grads[0][next(iter(params))].shape[0]
  x = {k: v.astype(np.float64) for k, v in params.items()}
  m = {k: np.zeros(v.shape) for k, v in params.items()}
  v = {k: np.zeros(v.shape) for k, v in params.items()}
  worker = {k: np.zeros((p, ds_padded(a.size, p))) for k, a in params.items()}
  server = {k: np.zeros((p, ds_padded(a.size, p) // p))
            for k, a in params.items()}
  for t, g in enumerate(grads):
    for k in x:
      gk = g[k].astype(np.float64)
      if t < freeze_step:  # warm-up: the engine all-reduces the gradient
        mean = gk.mean(0)
        m[k] = b1 * m[k] + (1 - b1) * mean
        v[k] = b2 * v[k] + (1 - b2) * mean * mean
      else:  # variance frozen; local momentum, 1-bit averaged
        local = (b1 * m[k][None] + (1 - b1) * gk).reshape(p, -1)
        m[k] = ds_compressed_allreduce(local, worker[k], server[k]).reshape(
            x[k].shape)
      update = m[k] / (np.sqrt(v[k]) + eps) + weight_decay * x[k]
      x[k] = x[k] - (lr(t) if callable(lr) else lr) * update
  return x, m, v, worker, server


# -- the user's idiom ------------------------------------------------------

SHAPES = {"b": (5,), "w": (12, 10), "z": (40, 33)}


def _loss(p, g):
  """A loss whose gradient on each device is the gradient given to it."""
  return sum(jnp.vdot(p[k], g[k][0]) for k in p)


def _grads(steps, seed=0):
  rng = np.random.default_rng(seed)
  return [{k: (rng.normal(size=(8,) + s) * rng.uniform(0.1, 2.0, (8,) + (1,) * len(s))
               ).astype(np.float32) for k, s in SHAPES.items()}
          for _ in range(steps)]


def _params(seed=1):
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


def _put(g, mesh):
  return jax.device_put(g, NamedSharding(mesh, P("data")))


@pytest.mark.parametrize("freeze_step,steps,weight_decay",
                         [(3, 8, 0.0), (4, 7, 0.01)])
def test_onebit_adam_is_the_papers_algorithm(mesh8, freeze_step, steps,
                                             weight_decay):
  hp = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)
  tx = jaxcomp.onebit_adam(hp["lr"], axis_name="data", freeze_step=freeze_step,
                           b1=hp["b1"], b2=hp["b2"], eps=hp["eps"],
                           weight_decay=weight_decay)
  params, grads = _params(), _grads(steps)
  state = jaxcomp.init(tx, jax.tree.map(jnp.asarray, params), mesh8)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh8)
  for g in grads:
    state, _ = step(state, _put(g, mesh8))
  x, m, v, worker, server = reference_onebit_adam(
      params, grads, freeze_step=freeze_step, **hp)
  st = state.opt_state
  for i, k in enumerate(sorted(SHAPES)):
    np.testing.assert_allclose(np.asarray(state.params[k]), x[k], rtol=1e-6,
                               atol=1e-7)
    np.testing.assert_allclose(np.asarray(st.mu[k]), m[k], rtol=1e-6,
                               atol=1e-7)
    np.testing.assert_allclose(np.asarray(st.nu[k]), v[k], rtol=1e-6,
                               atol=1e-12)
    # The errors are differences of nearly equal numbers: absolute
    # agreement, relative to the size of what was compressed.
    scale = np.abs(worker[k]).max()
    np.testing.assert_allclose(np.asarray(st.worker_error[i]), worker[k],
                               rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(np.asarray(st.server_error[i]), server[k],
                               rtol=0, atol=1e-5 * scale)
  # Compressed steps happened: the errors are not zero.
  assert all(np.abs(np.asarray(e)).max() > 0 for e in st.worker_error)
  t = jaxcomp.get_stats(st)
  assert (t.dense_steps, t.compressed_steps) == (freeze_step,
                                                 steps - freeze_step)


def test_onebit_adam_takes_a_schedule(mesh8):
  """An optax schedule of the step count is the learning rate."""
  sched = lambda count: 1e-2 / (1.0 + count.astype(jnp.float32))
  tx = jaxcomp.onebit_adam(sched, axis_name="data", freeze_step=2)
  params, grads = _params(), _grads(4, seed=3)
  state = jaxcomp.init(tx, jax.tree.map(jnp.asarray, params), mesh8)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh8)
  for g in grads:
    state, _ = step(state, _put(g, mesh8))
  x, m, _, _, _ = reference_onebit_adam(
      params, grads, freeze_step=2, lr=lambda t: 1e-2 / (1.0 + t), b1=0.9,
      b2=0.999, eps=1e-8, weight_decay=0.0)
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(state.params[k]), x[k], rtol=1e-6,
                               atol=1e-7)
    np.testing.assert_allclose(np.asarray(state.opt_state.mu[k]), m[k],
                               rtol=1e-6, atol=1e-7)


def test_onebit_adam_resumes_from_orbax_bit_for_bit(mesh8, tmp_path):
  pytest.importorskip("orbax.checkpoint")
  tx = jaxcomp.onebit_adam(1e-2, axis_name="data", freeze_step=2)
  grads = [_put(g, mesh8) for g in _grads(7, seed=5)]
  params = jax.tree.map(jnp.asarray, _params())
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh8, donate=False)
  state = jaxcomp.init(tx, params, mesh8)
  cut = 4  # two 1-bit steps in: the errors are live
  for g in grads[:cut]:
    state, _ = step(state, g)
  assert np.abs(np.asarray(state.opt_state.server_error[1])).max() > 0
  ckpt = jaxcomp.checkpoint.Checkpointer(tmp_path)
  ckpt.save(cut, {"params": state.params, "opt_state": state.opt_state})
  a = state
  for g in grads[cut:]:
    a, _ = step(a, g)
  fresh = jaxcomp.init(tx, params, mesh8)
  _, restored = ckpt.restore({"params": fresh.params,
                              "opt_state": fresh.opt_state})
  r = dataclasses.replace(fresh, params=restored["params"],
                          opt_state=restored["opt_state"])
  for g in grads[cut:]:
    r, _ = step(r, g)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(r)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_onebit_adam_counts_the_bytes_of_each_phase(mesh8):
  tx = jaxcomp.onebit_adam(1e-3, axis_name="data", freeze_step=3)
  params = jax.tree.map(jnp.asarray, _params())
  state = jaxcomp.init(tx, params, mesh8)
  stats = state.opt_state.stats
  sizes = [int(np.prod(SHAPES[k])) for k in sorted(SHAPES)]
  dense = 4 * sum(sizes)
  # Per chunk: ceil(N_i / 8 / 32) words of signs; per leaf 3 scales.
  words = sum(-(-ds_padded(n, 8) // 8 // 32) for n in sizes)
  compressed = 4 * 8 * words + 4 * words + 2 * 4 * len(sizes)
  assert float(stats.dense_bytes) == dense
  assert float(stats.compressed_bytes) == compressed
  assert float(stats.dense_wire_bytes) == pytest.approx(
      sum(2 * 7 / 8 * 4 * n for n in sizes))
  assert float(stats.compressed_wire_bytes) == pytest.approx(
      7 / 8 * 4 * 8 * words + 7 * (4 * words + 2 * 4 * len(sizes)))
  assert float(stats.state_bytes) == sum(
      4 * (ds_padded(n, 8) + ds_padded(n, 8) // 8) for n in sizes)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh8)
  for g in _grads(5, seed=2):
    state, _ = step(state, _put(g, mesh8))
  t = jaxcomp.get_stats(state.opt_state)
  assert (t.dense_steps, t.compressed_steps, t.silent_steps) == (3, 2, 0)
  assert t.total_bytes == 3 * dense + 2 * compressed
  assert t.dense_total_bytes == 5 * dense
  assert t.reduction == pytest.approx(5 * dense / (3 * dense + 2 * compressed))
  # A 1-bit exchange is about 1/32 of the dense all-reduce, plus scales
  # and padding (small leaves pad to 64 elements on 8 devices).
  assert dense / compressed > 15
  # The performance model prices the same run with the same bytes.
  priced = perfmodel.optimizer_traffic(
      perfmodel.CompressedOptimizer("onebit_adam", steps=5, freeze_step=3),
      sizes, 8)
  assert priced._asdict() == pytest.approx(t._asdict())
  # By path, the same report at the optimizer state's path (the root).
  assert jaxcomp.get_stats(state.opt_state, by_path=True) == {"": t}


@pytest.mark.parametrize("kwargs,name", [
    (dict(freeze_step=0), "freeze_step"),
    (dict(freeze_step=2.5), "freeze_step"),
    (dict(freeze_step=True), "freeze_step"),
    (dict(freeze_step=2, b1=1.0), "b1"),
    (dict(freeze_step=2, b2=-0.1), "b2"),
    (dict(freeze_step=2, eps=-1.0), "eps"),
    (dict(freeze_step=2, weight_decay=-1e-3), "weight_decay"),
    (dict(freeze_step=2, learning_rate=-1.0), "learning_rate"),
    (dict(freeze_step=2, learning_rate="fast"), "learning_rate"),
    (dict(freeze_step=2, axis_name=""), "axis_name"),
])
def test_onebit_adam_refuses_bad_arguments_at_construction(kwargs, name):
  kwargs = {"learning_rate": 1e-3, "axis_name": "data", **kwargs}
  with pytest.raises(ValueError, match=name):
    jaxcomp.onebit_adam(kwargs.pop("learning_rate"), **kwargs)


def test_onebit_adam_stats_are_what_the_compiled_step_sends(mesh8):
  """The warm-up branch's all-reduces and the 1-bit branch's all-to-all
  and all-gathers of the compiled step, operand bytes per device, are the
  state's dense and compressed bytes."""
  tx = jaxcomp.onebit_adam(1e-3, axis_name="data", freeze_step=3)
  state = jaxcomp.init(tx, jax.tree.map(jnp.asarray, _params()), mesh8)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh8)
  batch = _put(_grads(1)[0], mesh8)
  ops = jaxcomp.collective_traffic(step.lower(state, batch).compile()).ops
  branch = [o for o in ops if o.in_branch]
  dense = sum(o.operand_bytes for o in branch if o.kind == "all-reduce")
  onebit = sum(o.operand_bytes for o in branch
               if o.kind in ("all-to-all", "all-gather"))
  stats = state.opt_state.stats
  assert dense == float(stats.dense_bytes)
  assert onebit == float(stats.compressed_bytes)


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_an_fsdp_layout_refuses_the_compressed_optimizers_by_name(mesh8, name):
  """They keep whole replicated parameters, momentum and variance and run
  their own exchange of the whole momentum: jaxcomp.init refuses FSDP
  naming the optimizer and the layout to use."""
  make = getattr(jaxcomp, name)
  tx = (make(1e-3, var_freeze_step=2) if name == "zero_one_adam"
        else make(1e-3, freeze_step=2))
  fix = "Islands" if name == "zero_one_adam" else "DataParallel"
  with pytest.raises(ValueError, match=rf"jaxcomp\.{name}.*FSDP.*{fix}"):
    jaxcomp.init(tx, {"w": jnp.zeros((64,))}, mesh8, layout=jaxcomp.FSDP())


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam",
                                  "onebit_lamb"])
def test_a_nonfinite_gradient_on_one_device_skips_the_step_everywhere(mesh8,
                                                                      name):
  """nonfinite="skip" (the default, optimizers._exchange.guard_nonfinite):
  a NaN in device 3's gradient on a 1-bit step leaves every device's
  parameters and state (errors, momentum, step and phase counters) bit for
  bit as they were but for one more stats.skipped_steps, which get_stats
  reports; the next finite step goes on from there."""
  make = getattr(jaxcomp, name)
  tx = (make(1e-2, var_freeze_step=1) if name == "zero_one_adam"
        else make(1e-2, freeze_step=1))
  layout = (jaxcomp.Islands() if name == "zero_one_adam"
            else jaxcomp.DataParallel())
  state = jaxcomp.init(tx, jax.tree.map(jnp.asarray, _params()), mesh8,
                       layout=layout)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh8, layout=layout,
                                 donate=False)
  g0, g1 = _grads(2, seed=3)
  state, _ = step(state, _put(g0, mesh8))  # the dense step
  bad = {k: v.copy() for k, v in g1.items()}
  bad["w"][3, 0, 0] = np.nan
  after = state
  for skipped in (1, 2):
    before = after
    after, _ = step(before, _put(bad, mesh8))
    stats = before.opt_state.stats
    want = before.opt_state._replace(stats=stats._replace(
        skipped_steps=stats.skipped_steps + 1))
    got = jax.tree.leaves((after.params, after.opt_state))
    assert len(got) == len(jax.tree.leaves((before.params, want)))
    for x, y in zip(jax.tree.leaves((before.params, want)), got):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert np.all(np.asarray(after.opt_state.stats.skipped_steps) == skipped)
    assert jaxcomp.get_stats(after.opt_state).skipped_steps == skipped
  after, _ = step(after, _put(g1, mesh8))
  assert all(np.isfinite(np.asarray(x)).all()
             for x in jax.tree.leaves((after.params, after.opt_state)))
  t = jaxcomp.get_stats(after.opt_state)
  assert (t.compressed_steps, t.skipped_steps) == (1, 2)
  # The skipped steps are not among the steps taken, nor in the totals.
  assert t.dense_steps + t.compressed_steps + t.silent_steps == 2
  assert t.total_bytes == (t.dense_steps * t.dense_bytes_per_exchange
                           + t.compressed_bytes_per_exchange)


def test_the_checkpoint_records_the_hyperparameters(mesh8):
  """They are static data of the state, saved in a checkpoint's config
  beside compressed_mean's (jaxcomp.checkpoint.describe)."""
  tx = jaxcomp.onebit_lamb(lambda c: 1e-3 * c, freeze_step=7, max_coeff=8.0)
  state = jaxcomp.init(tx, {"w": jnp.zeros((64,))}, mesh8)
  (path, config), = optimizers.optimizer_configs(state.opt_state).items()
  assert config["optimizer"] == "onebit_lamb"
  assert (config["freeze_step"], config["max_coeff"],
          config["learning_rate"], config["nonfinite"]) == (7, 8, "scheduled",
                                                            "skip")
  saved = jaxcomp.checkpoint.describe(state.opt_state)["config"]
  assert saved[f"{path}: freeze_step"] == 7
  assert saved[f"{path}: b2"] == 0.999
