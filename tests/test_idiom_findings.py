"""The smaller findings of trying jaxcomp in users' idioms: a pmap step
that averages its gradient before the chain, pytrees with non-array leaves
(Equinox), jaxcomp.flax.Optimizer inside a user's own nnx.jit step, and
steps skipped by jaxcomp.apply_if_finite."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxcomp
import jaxcomp.flax
from jaxcomp.transform import PerDeviceUnchecked
from tests.helpers import sharded_update, stacked


def test_pmap_warns_that_it_cannot_see_an_averaged_gradient():
  n = jax.local_device_count()
  tx = jaxcomp.compressed_mean("topk", "data", ratio=0.5)

  def step(g):
    g = jax.lax.pmean(g, "data")  # the mistake: averaged before the chain
    st = tx.init(g)
    return tx.update(g, st)[0]

  with pytest.warns(PerDeviceUnchecked, match=r"no lax\.pmean / psum of the "
                    r"gradient comes before it"):
    jax.pmap(step, axis_name="data")(jnp.ones((n, 8)))


def test_shard_map_refuses_the_averaged_gradient_and_does_not_warn(mesh8):
  tx = jaxcomp.compressed_mean("topk", "data", ratio=0.5)
  state, specs = jaxcomp.placement.init_sharded(tx, {"w": jnp.zeros(8)}, mesh8, "data")

  def body(s):
    g = {"w": jax.lax.pmean(jnp.ones(8), "data")}  # typed invariant
    return tx.update(g, jaxcomp.placement.to_local(s, specs))[0]

  with warnings.catch_warnings():
    warnings.simplefilter("error", PerDeviceUnchecked)
    with pytest.raises(TypeError, match="already summed"):
      jax.shard_map(body, mesh=mesh8, in_specs=(specs,),
                    out_specs=jax.sharding.PartitionSpec())(state)


def test_a_non_array_leaf_is_refused_naming_it_and_the_fix(mesh8):
  # An Equinox-like model: arrays beside the activation function.
  model = {"w": jnp.zeros((4, 4)), "act": jax.nn.relu}
  tx = optax.chain(jaxcomp.compressed_mean("topk", "data"), optax.sgd(0.1))
  with pytest.raises(TypeError, match=r"params\['act'\] is a custom_jvp, not "
                     r"an array.*eqx\.partition\(model, eqx\.is_array\)"):
    jaxcomp.placement.init_sharded(tx, model, mesh8, "data")
  grad_fn = jaxcomp.compressed_value_and_grad(
      lambda p, b: jnp.sum(p["w"]), jaxcomp.compressed_mean("topk", "data"),
      mesh8)
  with pytest.raises(TypeError, match=r"params\['act'\]"):
    grad_fn.init(model)


def test_the_partitioned_arrays_train():
  """The fix the message gives: the arrays alone go to jaxcomp, the rest is
  recombined inside the loss."""
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  model = {"w": jnp.ones((4,)) * 0.5, "act": jnp.tanh}
  arrays = {"w": model["w"]}
  static = {"act": model["act"]}

  def loss_fn(p, x):
    return jnp.mean(static["act"](x @ p["w"]) ** 2)

  tx = optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.5),
                   optax.sgd(0.1))
  state = jaxcomp.init(tx, arrays, mesh)
  step = jaxcomp.make_train_step(loss_fn, tx, mesh=mesh)
  x = jax.device_put(jnp.ones((2 * jax.device_count(), 4)),
                     jax.sharding.NamedSharding(mesh,
                                                jax.sharding.PartitionSpec("data")))
  _, l0 = step(state, x)
  assert np.isfinite(float(l0))


class _MLP(nnx.Module):

  def __init__(self, rngs):
    self.lin = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.lin(x)


def test_nnx_optimizer_in_a_users_own_nnx_jit_step_names_train_step():
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  model = _MLP(nnx.Rngs(0))
  tx = optax.chain(jaxcomp.compressed_mean("topk", "data"), optax.sgd(0.1))
  optimizer = jaxcomp.flax.Optimizer(model, tx, wrt=nnx.Param, mesh=mesh)

  @nnx.jit
  def step(model, optimizer, x):
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)

  with pytest.raises(NameError, match=r"jaxcomp\.flax\.train_step\(loss_fn\)"):
    step(model, optimizer, jnp.ones((8, 4)))


def test_apply_if_finite_counts_its_skips_and_leaves_the_inner_state(mesh8):
  # The step apply_if_finite skips is counted in its own total_notfinite;
  # the transforms inside did not run, so their state, statistics included,
  # is bit for bit what it was (get_stats' skipped_steps counts only the
  # transform's own skips).
  tx = jaxcomp.apply_if_finite(optax.chain(
      jaxcomp.compressed_mean("topk", "data", ratio=0.5), optax.sgd(0.1)),
      "data")
  f, state, _ = sharded_update(tx, {"w": jnp.zeros(16)}, mesh8)
  good = stacked({"w": jnp.ones((8, 16))}, mesh8)
  bad = stacked({"w": jnp.ones((8, 16)).at[3, 2].set(jnp.nan)}, mesh8)
  _, state = f(good, state)
  before = jax.tree.leaves(state.inner_state)
  _, state = f(bad, state)
  assert int(state.total_notfinite) == 1
  for a, b in zip(before, jax.tree.leaves(state.inner_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(jaxcomp.get_stats(state).skipped_steps) == 0
  _, state = f(good, state)
  assert int(state.total_notfinite) == 1
