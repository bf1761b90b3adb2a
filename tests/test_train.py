"""The one door of shard_map steps: jaxcomp.init -> TrainState ->
jaxcomp.make_train_step, the same for every layout."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomp

PARAMS = {"w": jnp.arange(18.0).reshape(6, 3) / 10, "b": jnp.ones(3)}


def loss_fn(p, batch):
  x, y = batch
  return jnp.mean((x @ p["w"] + p["b"][None, :] - y) ** 2)


def _batch(mesh, n=16):
  return jax.device_put(
      (jax.random.normal(jax.random.key(0), (n, 6)),
       jax.random.normal(jax.random.key(1), (n, 3))),
      NamedSharding(mesh, P("data")))


def _tx(output="mean"):
  return optax.chain(jaxcomp.compressed_mean("identity", "data", output=output),
                     optax.sgd(0.1))


def test_every_layout_goes_through_one_init_and_one_step(mesh8):
  """Dense (identity) exchanges: the replicated, FSDP and per-device DiLoCo
  (synced every step, outer SGD(1)) layouts take the same steps, so their
  whole parameters agree; each state is a TrainState and steps in place."""
  batch = _batch(mesh8)
  diloco = jaxcomp.diloco(optax.sgd(0.1), sync_every=1, outer=optax.sgd(1.0),
                          compressor="identity")
  runs = {}
  for name, tx, layout in [
      ("replicated", _tx(), jaxcomp.DataParallel()),
      ("fsdp", _tx("shard"), jaxcomp.FSDP()),
      ("islands", diloco, jaxcomp.Islands())]:
    state = jaxcomp.init(tx, PARAMS, mesh8, layout=layout)
    assert isinstance(state, jaxcomp.TrainState)
    step = jaxcomp.make_train_step(loss_fn, tx, mesh=mesh8, layout=layout)
    losses = []
    for _ in range(3):
      state, loss = step(state, batch)
      losses.append(float(loss))
    runs[name] = (losses, jax.tree.map(np.asarray, state.model_params()))
  want_losses, want = runs.pop("replicated")
  for name, (losses, params) in runs.items():
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, err_msg=name)
    for k in want:
      np.testing.assert_allclose(params[k], want[k], rtol=1e-5, atol=1e-6,
                                 err_msg=f"{name} {k}")


def test_the_layouts_place_the_parameters_as_they_say(mesh8):
  fsdp = jaxcomp.init(_tx("shard"), PARAMS, mesh8, layout=jaxcomp.FSDP())
  assert fsdp.params["w"].shape == (24,)  # 18 elements, 3 per device (8)
  assert fsdp.params["w"].sharding.spec == P("data")
  assert fsdp.layout.shapes["w"].shape == (6, 3)
  np.testing.assert_array_equal(np.asarray(fsdp.model_params()["w"]),
                                np.asarray(PARAMS["w"]))
  tx = jaxcomp.diloco(optax.sgd(0.1), sync_every=4)
  islands = jaxcomp.init(tx, PARAMS, mesh8, layout=jaxcomp.Islands())
  assert islands.params["w"].shape == (8, 6, 3)
  np.testing.assert_array_equal(np.asarray(islands.model_params()["w"]),
                                np.asarray(PARAMS["w"]))
  replicated = jaxcomp.init(_tx(), PARAMS, mesh8)
  assert replicated.params["w"].sharding.spec == P()
  assert replicated.model_params() is replicated.params


def test_a_step_compiles_once_for_its_state(mesh8):
  traces = []

  def counted(p, batch):
    traces.append(1)
    return loss_fn(p, batch)

  tx = _tx()
  state = jaxcomp.init(tx, PARAMS, mesh8)
  step = jaxcomp.make_train_step(counted, tx, mesh=mesh8)
  batch = _batch(mesh8)
  for _ in range(4):
    state, _ = step(state, batch)
  assert len(traces) == 1


def test_a_state_placed_otherwise_is_refused_naming_the_difference(mesh8):
  tx = _tx("shard")
  state = jaxcomp.init(tx, PARAMS, mesh8, layout=jaxcomp.FSDP())
  batch = _batch(mesh8)
  with pytest.raises(ValueError, match=r"layout=FSDP\(.*the step runs layout="
                                       r"DataParallel"):
    jaxcomp.make_train_step(loss_fn, tx, mesh=mesh8,
                            layout=jaxcomp.DataParallel())(state, batch)
  with pytest.raises(ValueError, match="another mesh"):
    other = jax.make_mesh((8,), ("data",), devices=jax.devices()[::-1])
    jaxcomp.make_train_step(loss_fn, tx, mesh=other)(state, batch)
  with pytest.raises(TypeError, match="takes the TrainState that jaxcomp.init"):
    jaxcomp.make_train_step(loss_fn, tx, mesh=mesh8)(
        (state.params, state.opt_state), batch)
  with pytest.raises(TypeError, match="layout must be a jaxcomp layout"):
    jaxcomp.init(tx, PARAMS, mesh8, layout="fsdp")
  # The layout given to the step may omit what init filled in (the shapes).
  step = jaxcomp.make_train_step(loss_fn, tx, mesh=mesh8, layout=jaxcomp.FSDP())
  state, loss = step(state, batch)
  assert np.isfinite(float(loss))


def test_diloco_and_its_layout_go_together(mesh8):
  diloco = jaxcomp.diloco(optax.sgd(0.1), sync_every=4)
  with pytest.raises(ValueError, match=r"diloco needs each device's own "
                                       r"parameters.*layout=jaxcomp.Islands\(\)"):
    jaxcomp.init(diloco, PARAMS, mesh8)
  with pytest.raises(ValueError, match=r"only jaxcomp.diloco in tx "
                                       r"synchronizes"):
    jaxcomp.init(_tx(), PARAMS, mesh8, layout=jaxcomp.Islands())
