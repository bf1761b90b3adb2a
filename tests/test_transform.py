"""compressed_mean under shard_map and pmap: exactness, error feedback,
randomness, non-finite policy and bad input."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp._parts import concat as concat_parts
from tests.helpers import run_pmap, run_shard_map, sharded_update, stacked

P_DEV = 8


def grads_tree(seed=0, shapes=((37, 11), (5,), (300,))):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return {f"l{i}": jax.random.normal(k, (P_DEV, *s))
          for i, (k, s) in enumerate(zip(keys, shapes))}


def test_identity_equals_pmean_bitwise_shard_map(mesh8):
  g = grads_tree()
  u, ref, _, _ = run_shard_map(jaxcomp.compressed_mean("identity", "data"), g, mesh8)
  for k in g:
    np.testing.assert_array_equal(np.asarray(u[k]), np.asarray(ref[k]))


def test_identity_equals_pmean_bitwise_pmap(mesh8):
  g = grads_tree(1)
  u, ref, _ = run_pmap(jaxcomp.compressed_mean("identity", "data"), g)
  for k in g:
    np.testing.assert_array_equal(np.asarray(u[k]), np.asarray(ref[k]))


@pytest.mark.parametrize("name,kwargs", [("cast", {"dtype": "float32"}),
                                         ("topk", {"ratio": 1.0})])
@pytest.mark.parametrize("runner", ["shard_map", "pmap"])
def test_exact_compressors_match_pmean(mesh8, name, kwargs, runner):
  g = grads_tree(2)
  tx = jaxcomp.compressed_mean(name, "data", **kwargs)
  if runner == "shard_map":
    u, ref, _, _ = run_shard_map(tx, g, mesh8)
  else:
    u, ref, _ = run_pmap(tx, g)
  for k in g:
    np.testing.assert_allclose(np.asarray(u[k]), np.asarray(ref[k]),
                               rtol=1e-6, atol=1e-6)


def test_topk_ratio_one_leaves_zero_residual(mesh8):
  g = grads_tree(3)
  _, _, state, _ = run_shard_map(
      jaxcomp.compressed_mean("topk", "data", ratio=1.0), g, mesh8)
  for r in state.feedback:
    np.testing.assert_array_equal(np.asarray(concat_parts(r)), 0.0)


@pytest.mark.parametrize("name,kwargs", [("topk", {"ratio": 0.05}),
                                         ("random_block", {"ratio": 0.1}),
                                         # two-phase keeps a second residual,
                                         # checked in test_collectives_two_phase
                                         ("qsgd", {"levels": 2,
                                                   "collective": "allgather"})])
def test_error_feedback_conserves_mass(mesh8, name, kwargs):
  """Over a run, p * sum_t mean_t == sum_devices (sum_t g_t - e_T): what was
  sent plus what is left equals what came in (e_0 = 0)."""
  tx = jaxcomp.compressed_mean(name, "data", error_feedback=True,
                               bucketing="whole", **kwargs)
  steps = [grads_tree(10 + t, shapes=((64,), (40,))) for t in range(4)]
  sent_total = None
  state = None
  params = {k: jnp.zeros(v.shape[1:]) for k, v in steps[0].items()}
  f, state, _ = sharded_update(tx, params, mesh8)
  for g in steps:
    u, state = f(stacked(g, mesh8), state)
    flat_u = jnp.concatenate([u["l0"], u["l1"]])
    sent_total = flat_u if sent_total is None else sent_total + flat_u
  g_total = sum(jnp.concatenate([g["l0"], g["l1"]], axis=1) for g in steps)
  residual = concat_parts(state.feedback[0])  # (devices, n)
  lhs = P_DEV * sent_total
  rhs = jnp.sum(g_total - residual, axis=0)
  np.testing.assert_allclose(np.asarray(lhs), np.asarray(rhs), rtol=1e-5,
                             atol=1e-4)
  assert float(jnp.max(jnp.abs(residual))) > 0  # something was held back


def test_qsgd_unbiased_and_variance_bound():
  comp = jaxcomp.compressors.get("qsgd", levels=4, bucket_size=256)
  n, trials = 600, 4000
  x = jax.random.normal(jax.random.key(0), (n,))
  keys = jax.random.split(jax.random.key(1), trials)
  q = jax.jit(jax.vmap(lambda k: comp.decode(comp.encode(x, k), n, k)))(keys)
  mean = jnp.mean(q, axis=0)
  # Per element, the level rounding is Bernoulli: variance <= (norm/s)^2 / 4.
  norms = np.asarray(comp.encode(x, keys[0])["norms"])
  norm_el = np.repeat(norms, 256)[:n]
  sigma = norm_el / comp.levels / 2 / math.sqrt(trials)
  assert np.all(np.abs(np.asarray(mean - x)) <= 6 * sigma + 1e-6)
  # Lemma 3.1: E||Q(x) - x||^2 <= min(d/s^2, sqrt(d)/s) ||x_b||^2 per bucket.
  err = jnp.mean(jnp.sum((q - x[None, :]) ** 2, axis=1))
  d, s = 256, comp.levels
  bound = min(d / s**2, math.sqrt(d) / s) * float(jnp.sum(x * x))
  assert float(err) <= bound
  assert float(err) > 0


def test_random_block_same_block_on_every_device_and_covers(mesh8):
  n, ratio = 100, 0.1
  tx = jaxcomp.compressed_mean("random_block", "data", ratio=ratio,
                               error_feedback=False)
  # Device i sends (i + 1) everywhere: the mean on the block is 4.5 only if
  # every device picked the same block.
  g = {"w": jnp.broadcast_to(jnp.arange(1, P_DEV + 1, dtype=jnp.float32)[:, None],
                             (P_DEV, n))}
  params = {"w": jnp.zeros((n,))}
  state, specs = jaxcomp.placement.init_sharded(tx, params, mesh8, "data")
  from jax.sharding import PartitionSpec as P
  from tests.helpers import stacked

  def body(g, s):
    u, s = tx.update(jax.tree.map(lambda x: x[0], g), jaxcomp.placement.to_local(s, specs))
    return u, jaxcomp.placement.to_global(s, specs)

  f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=(P("data"), specs),
                            out_specs=(P(), specs)))
  covered = np.zeros(n, bool)
  starts = set()
  gs = stacked(g, mesh8)
  for _ in range(100):
    u, state = f(gs, state)
    w = np.asarray(u["w"])
    support = np.flatnonzero(w)
    assert len(support) == math.ceil(ratio * n)
    np.testing.assert_array_equal(w[support], 4.5)
    # Contiguous modulo n: exactly one wrap-around gap.
    gaps = np.diff(np.concatenate([support, support[:1] + n]))
    assert np.sum(gaps != 1) == 1
    starts.add(int(support[np.argmax(np.roll(gaps, 1) != 1)]))
    covered[support] = True
  assert covered.all()
  assert len(starts) > 50  # the block moves from step to step


@pytest.mark.parametrize("policy", ["skip", "zero", "propagate"])
def test_nonfinite_never_reaches_the_residual(mesh8, policy):
  tx = jaxcomp.compressed_mean("topk", "data", ratio=0.1, nonfinite=policy)
  good = grads_tree(5, shapes=((50,),))
  bad = jax.tree.map(lambda x: x.at[3, 7].set(jnp.nan).at[5, 2].set(jnp.inf),
                     good)
  u, _, state, _ = run_shard_map(tx, [good, bad], mesh8)
  assert np.isfinite(np.asarray(concat_parts(state.feedback[0]))).all()
  if policy == "skip":
    np.testing.assert_array_equal(np.asarray(u["l0"]), 0.0)
    assert int(state.stats.skipped_steps) == 1
  elif policy == "propagate":
    assert np.isnan(np.asarray(u["l0"])).all()
  else:
    assert np.isfinite(np.asarray(u["l0"])).all()
  # The step after is normal again and its residual is finite.
  u2, _, state2, _ = run_shard_map(tx, [good, bad, good], mesh8)
  assert np.isfinite(np.asarray(u2["l0"])).all()
  assert np.isfinite(np.asarray(concat_parts(state2.feedback[0]))).all()


def test_skip_leaves_state_unchanged(mesh8):
  tx = jaxcomp.compressed_mean("topk", "data", ratio=0.1)
  good = grads_tree(6, shapes=((50,),))
  bad = jax.tree.map(lambda x: x.at[0, 0].set(jnp.nan), good)
  _, _, s1, _ = run_shard_map(tx, [good], mesh8)
  _, _, s2, _ = run_shard_map(tx, [good, bad], mesh8)
  np.testing.assert_array_equal(np.asarray(concat_parts(s1.feedback[0])),
                                np.asarray(concat_parts(s2.feedback[0])))


def test_bf16_and_fp16_gradients_keep_their_dtype(mesh8):
  for dtype in (jnp.bfloat16, jnp.float16):
    g = {"w": jax.random.normal(jax.random.key(0), (P_DEV, 64)).astype(dtype)}
    for name, kw in [("topk", {"ratio": 0.5}), ("qsgd", {}), ("bf16", {}),
                     ("fp16", {}), ("random_block", {"ratio": 0.5})]:
      u, ref, _, _ = run_shard_map(jaxcomp.compressed_mean(name, "data", **kw),
                                   g, mesh8)
      assert u["w"].dtype == dtype, (name, dtype)
      assert np.isfinite(np.asarray(u["w"], np.float32)).all()


def test_fp16_prescale_avoids_overflow(mesh8):
  # 8 devices x 20000 overflows float16 (max 65504) if summed before dividing.
  g = {"w": jnp.full((P_DEV, 16), 20000.0)}
  u, _, _, _ = run_shard_map(jaxcomp.compressed_mean("fp16", "data"), g, mesh8)
  np.testing.assert_allclose(np.asarray(u["w"]), 20000.0, rtol=1e-3)


class TestBadInput:

  @pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5])
  def test_ratio(self, ratio):
    for name in ("topk", "random_block"):
      with pytest.raises(ValueError, match="ratio"):
        jaxcomp.compressed_mean(name, "data", ratio=ratio)

  def test_levels(self):
    with pytest.raises(ValueError, match="levels"):
      jaxcomp.compressed_mean("qsgd", "data", levels=0)

  @pytest.mark.parametrize("axis", ["", (), None])
  def test_empty_axis_name(self, axis):
    with pytest.raises(ValueError, match="axis_name"):
      jaxcomp.compressed_mean("identity", axis)

  def test_unknown_compressor(self):
    with pytest.raises(ValueError, match="unknown compressor 'nope'"):
      jaxcomp.compressed_mean("nope", "data")

  def test_unknown_keyword(self):
    with pytest.raises(TypeError, match="levels"):
      jaxcomp.compressed_mean("topk", "data", levels=3)

  def test_psum_needs_linear(self):
    with pytest.raises(ValueError, match="linear"):
      jaxcomp.compressed_mean("topk", "data", collective="psum")

  def test_bad_policy(self):
    with pytest.raises(ValueError, match="nonfinite"):
      jaxcomp.compressed_mean("identity", "data", nonfinite="ignore")

  def test_integer_and_bool_leaves(self, mesh8):
    tx = jaxcomp.compressed_mean("identity", "data")
    for bad in (jnp.zeros((P_DEV, 3), jnp.int32), jnp.zeros((P_DEV, 3), bool)):
      with pytest.raises(TypeError, match="only floating"):
        run_shard_map(tx, {"w": bad}, mesh8)

  def test_unbound_axis(self):
    tx = jaxcomp.compressed_mean("identity", "data")
    with pytest.raises(NameError, match="inside jax.shard_map"):
      tx.init({"w": jnp.zeros(3)})
    with pytest.raises(NameError, match="inside jax.shard_map"):
      jax.jit(lambda g: tx.update(g, None))({"w": jnp.zeros(3)})

  def test_init_sharded_unknown_axis(self, mesh8):
    tx = jaxcomp.compressed_mean("identity", "batch")
    with pytest.raises(ValueError, match="not in the mesh"):
      jaxcomp.placement.init_sharded(tx, {"w": jnp.zeros(3)}, mesh8, "batch")


def test_a_state_carried_to_another_ratio_reports_that_ratios_bytes(mesh8):
  # A DGC-style warm-up runs one transform per ratio over one state: the
  # stats after an update are those of the transform that made it, and the
  # error-feedback residual carries over (mass is conserved across the switch).
  n = 400
  wide = jaxcomp.compressed_mean("topk", "data", ratio=0.25)
  narrow = jaxcomp.compressed_mean("topk", "data", ratio=0.01)
  params = {"w": jnp.zeros((n,))}
  f_wide, state, _ = sharded_update(wide, params, mesh8)
  f_narrow, narrow_init, _ = sharded_update(narrow, params, mesh8)
  assert jax.tree.structure(state) == jax.tree.structure(narrow_init)
  g = np.random.default_rng(0).normal(size=(8, n)).astype(np.float32)
  u1, state = f_wide(stacked({"w": jnp.asarray(g)}, mesh8), state)
  assert float(jaxcomp.get_stats(state).bytes_sent) == 8 * 100
  u2, state = f_narrow(stacked({"w": jnp.asarray(g)}, mesh8), state)
  stats = jaxcomp.get_stats(state)
  assert float(stats.bytes_sent) == 8 * 4
  assert float(stats.bytes_sent) == float(jaxcomp.get_stats(narrow_init).bytes_sent)
  assert float(stats.compression_factor) == 4 * n / (8 * 4)
  # sum of what was averaged + mean residual == sum of the mean gradients.
  residual = np.asarray(concat_parts(state.feedback[0])).mean(0)  # (n,)
  np.testing.assert_allclose(np.asarray(u1["w"]) + np.asarray(u2["w"]) + residual,
                             2 * g.mean(0), rtol=1e-5, atol=1e-5)


def test_make_train_step_is_the_hand_written_step(mesh8):
  """make_train_step runs per_device_value_and_grad -> tx.update ->
  apply_updates -> pmean(loss): the same parameters, state and loss, bit for
  bit, as the step written by hand under shard_train_step."""
  import optax
  from jax import lax
  from jax.sharding import NamedSharding, PartitionSpec as P

  params = {"w": jnp.zeros((6, 3)), "b": jnp.zeros(3)}

  def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((x @ p["w"] + p["b"][None, :] - y) ** 2)

  # (optax.adam does not trace under the strict dtype promotion of the tests)
  tx = optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.3),
                   optax.sgd(0.1, momentum=0.9))
  state = jaxcomp.init(tx, params, mesh8)

  def hand(p, s, batch):
    loss, g = jaxcomp.per_device_value_and_grad(loss_fn, "data")(p, batch)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, lax.pmean(loss, "data")

  by_hand = jax.jit(jaxcomp.steps.shard_train_step(
      hand, mesh=mesh8, state_specs=state.specs, batch_spec=P("data")))
  step = jaxcomp.make_train_step(loss_fn, tx, mesh=mesh8, donate=False)
  batch = jax.device_put(
      (jax.random.normal(jax.random.key(0), (16, 6)),
       jax.random.normal(jax.random.key(1), (16, 3))),
      NamedSharding(mesh8, P("data")))
  a, b = state, (state.params, state.opt_state)
  for _ in range(3):
    a, loss_a = step(a, batch)
    *b, loss_b = by_hand(*b, batch)
    assert float(loss_a) == float(loss_b)
  assert isinstance(a, jaxcomp.TrainState) and a.specs is state.specs
  for x, y in zip(jax.tree.leaves((a.params, a.opt_state)), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  with pytest.raises(ValueError, match="not in the mesh"):
    jaxcomp.make_train_step(loss_fn, tx, mesh=mesh8, axis_name="model")


# Spies: the parts of one transform, counting the calls that init makes
# (the states' init) and that the statistics make (the declared transfers).
_CALLS: dict[str, int] = {}


def _count(what):
  _CALLS[what] = _CALLS.get(what, 0) + 1


@dataclasses.dataclass(frozen=True)
class _SpyFeedback(jaxcomp.feedback.ResidualFeedback):

  def init(self, sizes, axis_name):
    _count("feedback.init")
    return super().init(sizes, axis_name)


@dataclasses.dataclass(frozen=True)
class _SpyTwoPhase(jaxcomp.collectives.TwoPhase):

  def init_state(self, compressor, shapes, key, axis_name):
    _count("collective.init_state")
    return super().init_state(compressor, shapes, key, axis_name)

  def transfers(self, compressor, shapes, sizes, dtype=jnp.float32):
    _count("collective.transfers")
    return super().transfers(compressor, shapes, sizes, dtype)


def _spied(**kwargs):
  return jaxcomp.compressed_mean(
      "int8_block", "data", collective=_SpyTwoPhase(),
      error_feedback=_SpyFeedback(), bucketing="layerwise", **kwargs)


_SPY_PARAMS = {"w": jnp.zeros((8, 4)), "b": jnp.zeros((4,))}  # 2 buckets


def _trace_update(tx, state, specs, mesh):
  """Traces (no compile, no run) a fresh jit of ``tx.update`` under
  shard_map."""
  def body(g, s):
    u, s = tx.update(jax.tree.map(lambda x: x[0], g),
                     jaxcomp.placement.to_local(s, specs))
    return u, jaxcomp.placement.to_global(s, specs)

  grads = stacked(jax.tree.map(lambda x: jnp.ones((8,) + x.shape, x.dtype),
                               _SPY_PARAMS), mesh)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), specs),
                            out_specs=(P(), specs)))
  jax.eval_shape(f, grads, state)


def test_update_does_not_trace_init(mesh8):
  """``update`` checks the state against the shapes ``init`` recorded for
  the layout: tracing it calls neither the feedback's nor the collective's
  state init (it used to trace the whole ``init`` on every trace)."""
  tx = _spied()
  state, specs = jaxcomp.placement.init_sharded(tx, _SPY_PARAMS, mesh8, "data")
  assert _CALLS.pop("feedback.init") and _CALLS.pop("collective.init_state")
  _CALLS.clear()
  _trace_update(tx, state, specs, mesh8)
  assert "feedback.init" not in _CALLS, _CALLS
  assert "collective.init_state" not in _CALLS, _CALLS
  # The check still runs: a state of another model is refused by name.
  other, other_specs = jaxcomp.placement.init_sharded(
      tx, {"w": jnp.zeros((8, 5)), "b": jnp.zeros((4,))}, mesh8, "data")
  with pytest.raises(ValueError, match=r"the state leaf .* has shape"):
    _trace_update(tx, other, other_specs, mesh8)


def test_static_stats_are_computed_once_per_layout(mesh8):
  """The statistics' static fields (from the collective's declared
  transfers, once per bucket) are computed once per layout: an ``update``
  whose layout its own ``init`` never saw (a state from another transform
  of the same shapes, as a warm-up passes it on) computes them once, and
  finds the state's expected shapes from the per-device state alone; a
  second trace reuses both."""
  state, specs = jaxcomp.placement.init_sharded(_spied(), _SPY_PARAMS, mesh8, "data")
  tx = _spied()  # the same configuration, never initialised
  _CALLS.clear()
  _trace_update(tx, state, specs, mesh8)
  assert _CALLS == {"collective.transfers": 2, "feedback.init": 2,
                    "collective.init_state": 2}, _CALLS
  _CALLS.clear()
  _trace_update(tx, state, specs, mesh8)
  assert _CALLS == {}, _CALLS
  # Computed once, they are the statistics init wrote.
  f, state, _ = sharded_update(tx, _SPY_PARAMS, mesh8)
  _, after = f(stacked(jax.tree.map(lambda x: jnp.ones((8,) + x.shape),
                                    _SPY_PARAMS), mesh8), state)
  for field in ("bytes_sent", "dense_bytes", "wire_bytes", "state_bytes"):
    assert float(getattr(after.stats, field)) == float(
        getattr(state.stats, field)) > 0, field
