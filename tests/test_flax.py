"""Flax, idiomatically ([integration] item 3): an NNX optimizer and step
with per-device dropout and averaged BatchNorm statistics, and a Linen
TrainState, each with a jaxcomp transform in its tx."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomp
import jaxcomp.flax


class MLP(nnx.Module):

  def __init__(self, rngs, *, bn=False, dropout=0.0):
    self.lin = nnx.Linear(6, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, rngs=rngs) if bn else None
    self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else None
    self.out = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    h = self.lin(x)
    if self.bn is not None:
      h = self.bn(h)
    h = nnx.relu(h)
    if self.drop is not None:
      h = self.drop(h)
    return self.out(h)


def _loss(model, batch):
  x, y = batch
  return jnp.mean((model(x) - y) ** 2)


def _batch(mesh, n=32):
  return jax.device_put(
      (jax.random.normal(jax.random.key(0), (n, 6)),
       jax.random.normal(jax.random.key(1), (n, 3))),
      NamedSharding(mesh, P("data")))


def test_plain_nnx_optimizer_names_the_helper(mesh8):
  model = MLP(nnx.Rngs(0))
  with pytest.raises(NameError, match=r"jaxcomp\.flax\.Optimizer"):
    nnx.Optimizer(model, jaxcomp.compressed_mean("topk", "data"),
                  wrt=nnx.Param)


def _train_beside_nnx_optimizer(model, opt, ref, tx, batch, steps=3):
  """``steps`` of jaxcomp.flax.train_step on ``model`` beside nnx.Optimizer
  on ``ref`` with the whole batch on one device; the losses must agree.
  Returns the step function."""
  ref_opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)
  step = jaxcomp.flax.train_step(_loss)
  host = jax.device_get(batch)
  for _ in range(steps):
    loss = step(model, opt, batch)
    ref_loss, grads = nnx.value_and_grad(_loss)(ref, host)
    ref_opt.update(ref, grads)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
  return step


def test_nnx_identity_equals_full_batch_training(mesh8):
  """The identity exchange trains exactly as nnx.Optimizer does on the whole
  batch on one device (the mean of equal shards' mean losses)."""
  batch = _batch(mesh8)
  model = MLP(nnx.Rngs(0))
  ref = MLP(nnx.Rngs(0))
  tx = optax.sgd(0.1, momentum=0.9)
  opt = jaxcomp.flax.Optimizer(
      model, optax.chain(jaxcomp.compressed_mean("identity", "data"), tx),
      wrt=nnx.Param, mesh=mesh8)
  _train_beside_nnx_optimizer(model, opt, ref, tx, batch)
  for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                  jax.tree.leaves(nnx.state(ref, nnx.Param))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-6)
  assert int(opt.step[...]) == 3


def test_nnx_step_places_a_model_restored_onto_one_device(mesh8):
  """Parameters committed to one device (a checkpoint restored there): the
  step puts them on the mesh and trains as from placed ones, bit for bit."""
  batch = _batch(mesh8)
  tx = optax.chain(jaxcomp.compressed_mean("identity", "data"),
                   optax.sgd(0.1))
  models = [MLP(nnx.Rngs(0)), MLP(nnx.Rngs(0))]
  opts = [jaxcomp.flax.Optimizer(m, tx, wrt=nnx.Param, mesh=mesh8)
          for m in models]
  nnx.update(models[1], jax.device_put(nnx.state(models[1], nnx.Param),
                                       jax.devices()[1]))
  step = jaxcomp.flax.train_step(_loss)
  losses = [[float(step(m, o, batch)) for _ in range(2)]
            for m, o in zip(models, opts)]
  assert losses[0] == losses[1]
  for a, b in zip(jax.tree.leaves(nnx.state(models[0], nnx.Param)),
                  jax.tree.leaves(nnx.state(models[1], nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert b.sharding.is_fully_replicated
    assert b.devices() == set(mesh8.devices.flat)
  assert int(opts[1].step[...]) == 2


def test_nnx_fsdp_shards_the_model_and_trains_as_full_batch(mesh8):
  """layout=FSDP(): the model's parameters become flat shards (1/8 per device),
  the step gathers them, reduce-scatters the gradient and updates the
  shards; with identity it trains as nnx.Optimizer on the whole batch, and
  unsharded() gives back a whole model for evaluation."""
  batch = _batch(mesh8)
  model = MLP(nnx.Rngs(0))
  ref = MLP(nnx.Rngs(0))
  tx = optax.sgd(0.1, momentum=0.9)
  opt = jaxcomp.flax.Optimizer(
      model, optax.chain(jaxcomp.compressed_mean("identity", "data", output="shard"), tx),
      wrt=nnx.Param, mesh=mesh8, layout=jaxcomp.FSDP())
  kernel = nnx.state(model, nnx.Param)["lin"]["kernel"][...]
  assert kernel.shape == (8 * 12,) and kernel.sharding.spec == P("data")
  step = _train_beside_nnx_optimizer(model, opt, ref, tx, batch)
  full = jaxcomp.flax.unsharded(model, opt)
  for a, b in zip(jax.tree.leaves(nnx.state(full, nnx.Param)),
                  jax.tree.leaves(nnx.state(ref, nnx.Param))):
    assert a.shape == b.shape
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  x = jax.device_get(batch)[0]
  np.testing.assert_allclose(np.asarray(nnx.merge(*nnx.split(full))(x)),
                             np.asarray(ref(x)), rtol=1e-5, atol=1e-6)
  # Parameters and momentum are shards: 1/8 of the parameters per device
  # (each leaf padded to a multiple of 8; the state adds the scalar config,
  # count, key and statistics).
  from jaxcomp import fsdp
  shard_bytes = 4 * sum(-(-n // 8) for n in (96, 16, 48, 3))
  assert fsdp.state_bytes(nnx.state(model, nnx.Param)) == shard_bytes
  momentum = opt.opt_state[1][0].trace
  assert fsdp.state_bytes(nnx.state(momentum)) == shard_bytes
  # BatchNorm's statistics (not optimised) stay whole; the model trains.
  bn = MLP(nnx.Rngs(0), bn=True)
  with jax.numpy_dtype_promotion("standard"):  # optax.adam is not strict
    bn_opt = jaxcomp.flax.Optimizer(
        bn, optax.chain(jaxcomp.compressed_mean("int8_block", "data", output="shard",
                                                rounding="stochastic"), optax.adam(1e-2)),
        wrt=nnx.Param, mesh=mesh8, layout=jaxcomp.FSDP())
    losses = [float(step(bn, bn_opt, batch)) for _ in range(5)]
  assert losses[-1] < losses[0]
  assert nnx.state(bn, nnx.BatchStat)["bn"]["mean"][...].shape == (16,)
  with pytest.raises(ValueError, match="output='shard'"):
    jaxcomp.flax.Optimizer(MLP(nnx.Rngs(0)), optax.chain(
        jaxcomp.compressed_mean("identity", "data"), tx), wrt=nnx.Param, mesh=mesh8,
        layout=jaxcomp.FSDP())


def test_nnx_batchnorm_is_averaged_and_dropout_differs_per_device(mesh8):
  batch = _batch(mesh8)
  model = MLP(nnx.Rngs(0, dropout=1), bn=True, dropout=0.5)
  opt = jaxcomp.flax.Optimizer(
      model, optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.5),
                         optax.sgd(0.1)), wrt=nnx.Param, mesh=mesh8)
  # Each device's BatchNorm running mean after one step, by hand: momentum
  # 0.99 of zeros plus 0.01 of its shard's batch mean of lin(x).
  x = np.asarray(jax.device_get(batch[0])).reshape(8, 4, 6)
  w = np.asarray(model.lin.kernel.get_value())
  b = np.asarray(model.lin.bias.get_value())
  per_device = 0.01 * (x @ w + b).mean(axis=1)  # (8, 16)

  def loss_with_mask(model, batch):
    x, y = batch
    h = nnx.relu(model.bn(model.lin(x)))
    kept = model.drop(jnp.ones_like(h))
    return jnp.mean((model.out(h * kept) - y) ** 2), kept[0]

  step = jaxcomp.flax.train_step(loss_with_mask, has_aux=True)
  _, kept_mean = step(model, opt, batch)
  np.testing.assert_allclose(np.asarray(model.bn.mean.get_value()),
                             per_device.mean(axis=0), rtol=1e-5, atol=1e-7)
  # The averaged first-row mask is not a single device's 0/2 pattern: the
  # devices drew different masks.
  values = np.unique(np.round(np.asarray(kept_mean), 4))
  assert len(values) > 2
  with pytest.raises(TypeError, match="jaxcomp.flax.Optimizer"):
    step(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), batch)


def test_linen_train_state_identity_equals_optax(mesh8):
  import flax.linen as nn

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(nn.relu(nn.Dense(16)(x)))

  net = Net()
  params = net.init(jax.random.key(0), jnp.zeros((1, 6)))["params"]
  tx = optax.sgd(0.1, momentum=0.9)
  state, specs = jaxcomp.flax.create_train_state(
      net.apply, params, optax.chain(jaxcomp.compressed_mean("identity", "data"), tx),
      mesh=mesh8)

  def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((net.apply({"params": p}, x) - y) ** 2)

  def step_fn(state, batch):
    loss, grads = jaxcomp.per_device_value_and_grad(loss_fn, "data")(
        state.params, batch)
    return state.apply_gradients(grads=grads), lax.pmean(loss, "data")

  step = jaxcomp.flax.train_state_step(step_fn, mesh=mesh8, opt_specs=specs,
                                       donate=False)
  batch = _batch(mesh8)
  ref_p, ref_s = params, tx.init(params)
  host = jax.device_get(batch)
  for _ in range(3):
    state, loss = step(state, batch)
    ref_loss, g = jax.value_and_grad(loss_fn)(ref_p, host)
    u, ref_s = tx.update(g, ref_s, ref_p)
    ref_p = optax.apply_updates(ref_p, u)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
  assert int(state.step) == 3
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_p)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_jit_step_changes_only_its_gradient_line(mesh8):
  """A jax.jit step on a sharded batch (XLA partitions it; no hand-written
  per-device step): compressed_value_and_grad replaces jax.value_and_grad.
  With the identity exchange it is the full-batch gradient; with top-k no
  float32 all-reduce of gradient size is left in the compiled step."""
  params = {"w": jnp.full((6, 3), 0.1), "b": jnp.zeros((3,))}

  def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((x @ p["w"] + p["b"][None, :] - y) ** 2)

  optimizer = optax.sgd(0.1)
  batch = _batch(mesh8)
  for name, kw in (("identity", {}), ("topk", {"ratio": 0.2})):
    grad_fn = jaxcomp.compressed_value_and_grad(
        loss_fn, jaxcomp.compressed_mean(name, "data", **kw), mesh8)
    comp_state = grad_fn.init(params)

    @jax.jit
    def train_step(params, opt_state, comp_state, batch, grad_fn=grad_fn):
      (loss, grads), comp_state = grad_fn(params, comp_state, batch)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, comp_state, loss, grads

    out = train_step(params, optimizer.init(params), comp_state, batch)
    loss, grads = out[3], out[4]
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, jax.device_get(batch))
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    if name == "identity":
      for k in params:
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(ref_grads[k]),
                                   rtol=1e-5, atol=1e-6)
    else:
      traffic = jaxcomp.collective_traffic(train_step.lower(
          params, optimizer.init(params), comp_state, batch).compile())
      assert all(op.operand_bytes < 4 * 18 for op in traffic.ops
                 if op.kind == "all-reduce"), traffic.table()
