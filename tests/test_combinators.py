"""Optax combinators around a compressed chain ([integration] item 1, 2):
gradient accumulation that exchanges once per k micro-steps, skipping the
whole update on a non-finite gradient, per-leaf selection, and the optax
combinators that wrap or sit beside compressed_mean."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomp
from tests.helpers import run_shard_map, sharded_update, stacked

D = 24


def _loss(p, batch):
  x, y = batch
  return jnp.mean((x @ p["w"] + p["b"][None, :] - y) ** 2)


def _params():
  return {"w": jnp.full((D, 3), 0.1), "b": jnp.zeros((3,))}


def _batches(mesh, steps, n=32):
  keys = jax.random.split(jax.random.key(0), steps)
  return [jax.device_put(
      (jax.random.normal(k, (n, D)), jax.random.normal(jax.random.fold_in(k, 1), (n, 3))),
      NamedSharding(mesh, P("data"))) for k in keys]


def _train(tx, mesh, batches):
  state = jaxcomp.init(tx, _params(), mesh)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh, donate=False)
  for b in batches:
    state, _ = step(state, b)
  return state.params, state, step


def _chain(name="topk", **kw):
  return optax.chain(jaxcomp.compressed_mean(name, "data", **kw),
                     optax.sgd(0.1, momentum=0.9))


K = 4


def test_multi_steps_is_one_step_on_the_mean_gradient(mesh8):
  """k micro-steps of jaxcomp.multi_steps equal one step of the chain on
  the mean of the k micro-batches' gradients (identity: exact mean)."""
  batches = _batches(mesh8, K)
  got, _, _ = _train(jaxcomp.multi_steps(_chain("identity"), K), mesh8, batches)
  merged = jax.device_put(
      tuple(jnp.concatenate([jax.device_get(b[i]).reshape(8, -1, *b[i].shape[1:])
                             for b in batches], axis=1).reshape(-1, *batches[0][i].shape[1:])
            for i in range(2)), NamedSharding(mesh8, P("data")))
  want, _, _ = _train(_chain("identity"), mesh8, [merged])
  for k in ("w", "b"):
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]),
                               rtol=1e-5, atol=1e-6)


def test_optax_multisteps_around_the_chain_traces_and_agrees(mesh8):
  """optax.MultiSteps around the whole compressed chain: its accumulator is
  placed per device (derived from the update's types), so it traces, and
  it gives jaxcomp.multi_steps' parameters and error-feedback state."""
  batches = _batches(mesh8, 2 * K)
  ours, s1, _ = _train(jaxcomp.multi_steps(_chain(ratio=0.2), K), mesh8, batches)
  with jax.numpy_dtype_promotion("standard"):  # optax.MultiSteps is not strict
    theirs, s2, _ = _train(optax.MultiSteps(_chain(ratio=0.2), K), mesh8,
                           batches)
  for k in ("w", "b"):
    np.testing.assert_allclose(np.asarray(ours[k]), np.asarray(theirs[k]),
                               rtol=1e-5, atol=1e-6)
  r1 = jax.tree.leaves(s1.opt_state.inner_state[0].feedback)
  r2 = jax.tree.leaves(s2.opt_state.inner_opt_state[0].feedback)
  for a, b in zip(r1, r2):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_multi_steps_exchanges_only_on_the_kth_micro_step(mesh8):
  """From the compiled step: every compressed collective sits in the
  branch taken on the k-th micro-step; what runs on every micro-step is the
  loss pmean alone. optax.MultiSteps sends on every micro-step."""
  b = _batches(mesh8, 1)
  _, state, step = _train(jaxcomp.multi_steps(_chain(ratio=0.2), K), mesh8, [])
  t = jaxcomp.collective_traffic(step.lower(state, b[0]).compile())
  assert t.every_step().operand_bytes == 4  # the loss
  stats = jaxcomp.get_stats(state.opt_state)
  assert stats.every == K  # one exchange per K calls of the step
  assert t.in_branches().operand_bytes == float(stats.bytes_sent) + 4  # + flag
  with jax.numpy_dtype_promotion("standard"):  # optax.MultiSteps is not strict
    _, state2, step2 = _train(optax.MultiSteps(_chain(ratio=0.2), K), mesh8, [])
    t2 = jaxcomp.collective_traffic(step2.lower(state2, b[0]).compile())
  assert t2.every_step().operand_bytes >= float(stats.bytes_sent)


def test_apply_if_finite_leaves_adam_and_residuals_untouched(mesh8):
  """A NaN in one device's gradient: with jaxcomp.apply_if_finite around
  chain(compressed_mean, adam) the parameters and every optimizer state leaf
  (residuals, Adam's moments and count) stay bit for bit as they were; the
  next finite step proceeds."""
  tx = jaxcomp.apply_if_finite(optax.chain(
      jaxcomp.compressed_mean("topk", "data", ratio=0.2), optax.adam(1e-2)),
      "data")
  with jax.numpy_dtype_promotion("standard"):  # optax.adam is not strict
    params = _params()
    f, state, _ = sharded_update(tx, params, mesh8)
    g = jax.tree.map(lambda p: jax.random.normal(jax.random.key(1), (8, *p.shape)), params)
    _, state = f(stacked(g, mesh8), state)  # one good step: moments move
    before = jax.tree.leaves(state)
    bad = jax.tree.map(lambda x: x.at[3, 0].set(jnp.nan), g)
    u, state = f(stacked(bad, mesh8), state)
    for k in u:
      np.testing.assert_array_equal(np.asarray(u[k]), 0.0)
    after = jax.tree.leaves(state)
    assert int(state.total_notfinite) == 1 and not bool(state.last_finite)
    for a, b in zip(before[3:], after[3:]):  # all but the skip counters
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    u, state = f(stacked(g, mesh8), state)
    assert bool(state.last_finite) and float(jnp.abs(u["w"]).sum()) > 0


def test_apply_if_finite_runs_anyway_after_max_consecutive_errors(mesh8):
  tx = jaxcomp.apply_if_finite(_chain(ratio=0.5), "data",
                               max_consecutive_errors=1)
  params = _params()
  f, state, _ = sharded_update(tx, params, mesh8)
  bad = jax.tree.map(lambda p: jnp.full((8, *p.shape), jnp.nan), params)
  for _ in range(2):
    u, state = f(stacked(bad, mesh8), state)
  # The second run is let through; compressed_mean's "skip" policy keeps it
  # finite and zero.
  assert int(state.notfinite_count) == 2
  assert int(state.inner_state[0].stats.skipped_steps) == 1
  with pytest.raises(ValueError, match="max_consecutive_errors"):
    jaxcomp.apply_if_finite(_chain(), "data", max_consecutive_errors=-1)
  with pytest.raises(ValueError, match="every_k"):
    jaxcomp.multi_steps(_chain(), 0)


def test_mask_keeps_left_out_leaves_exact_and_passes_integers(mesh8):
  """compressed_mean(mask=...) averages the leaves it leaves out exactly
  (bitwise the pmean), compresses the rest, and gives non-floating leaves a
  zero update; the TypeError for an integer leaf recommends exactly this."""
  g = {"w": jax.random.normal(jax.random.key(0), (8, 64)),
       "b": jax.random.normal(jax.random.key(1), (8, 5))}
  mask = {"w": True, "b": False}
  u, ref, state, _ = run_shard_map(
      jaxcomp.compressed_mean("topk", "data", ratio=0.1, mask=mask), g, mesh8)
  np.testing.assert_array_equal(np.asarray(u["b"]), np.asarray(ref["b"]))
  assert np.count_nonzero(np.asarray(u["w"])) <= 8 * 7  # k = 7 per device
  stats = jaxcomp.get_stats(state)
  assert float(stats.bytes_sent) == 8 * 7 + 4 * 5
  # A function of the parameters works as optax.masked's does.
  u2, _, _, _ = run_shard_map(jaxcomp.compressed_mean(
      "topk", "data", ratio=0.1,
      mask=lambda t: jax.tree.map(lambda x: x.ndim > 1 and x.shape[-1] > 8, t)),
      g, mesh8)
  np.testing.assert_array_equal(np.asarray(u2["b"]), np.asarray(ref["b"]))

  tx = jaxcomp.compressed_mean("topk", "data")
  params = {"w": jnp.zeros((64,)), "step": jnp.zeros((), jnp.int32)}
  with pytest.raises(TypeError, match=r"mask=") as e:
    jaxcomp.init(tx, params, mesh8)
  assert "optax.masked" not in str(e.value)
  tx = jaxcomp.compressed_mean("topk", "data", mask={"w": True, "step": False})
  f, state, _ = sharded_update(tx, params, mesh8)
  u, _ = f(stacked({"w": jnp.ones((8, 64)),
                    "step": jnp.zeros((8,), jnp.int32)}, mesh8), state)
  assert u["step"].dtype == jnp.int32 and int(u["step"]) == 0


def test_inject_hyperparams_and_clip_by_global_norm_in_the_chain(mesh8):
  """A scheduled ratio and global-norm clipping of the averaged gradient
  (as DDP clips after the all-reduce) in one chain."""
  def make(ratio):
    return jaxcomp.compressed_mean("topk", "data", ratio=ratio, max_ratio=0.5)

  tx = optax.chain(optax.inject_hyperparams(make)(
      ratio=optax.linear_schedule(0.5, 0.1, 4)),
      optax.clip_by_global_norm(0.01), optax.sgd(1.0))
  p, state, _ = _train(tx, mesh8, _batches(mesh8, 3))
  moved = np.asarray(p["w"]) - 0.1
  assert 0 < np.sqrt((moved ** 2).sum() + (np.asarray(p["b"]) ** 2).sum()) <= 0.03 + 1e-6


def test_multi_steps_names_a_gradient_leaf_its_accumulator_cannot_hold(mesh8):
  # A gradient of another shape than the parameters the accumulator was
  # made for is refused at trace time, naming the leaf, not broadcast into
  # the sum.
  tx = jaxcomp.multi_steps(_chain("identity"), 2)
  f, state, _ = sharded_update(tx, _params(), mesh8)
  g = stacked({"w": jnp.ones((8, D, 3)), "b": jnp.ones((8, 1))}, mesh8)
  with pytest.raises(ValueError, match=r"gradient leaf \['b'\] has shape \(1,\).*\(3,\)"):
    jax.eval_shape(f, g, state)
