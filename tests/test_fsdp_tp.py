"""The jax.jit idiom on MaxText's default layout: parameters GSPMD shards
over an FSDP axis and a tensor axis at once (a ``(data, fsdp, tensor)``
mesh, the batch split over ``data`` and ``fsdp``). Each leaf sharded over
``fsdp`` has its gradient reduce-scattered over ``fsdp`` through the
compressor, then averaged over ``data``; the parameters keep their
shardings; compute, arguments, collectives and bytes are read from the
compiled modules against the plain GSPMD step's."""

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxcomp
import jaxcomp.flax
from tests.helpers import gspmd_sgd_steps

D, H = 64, 128
DATA = ("data", "fsdp")
SPECS = {"w1": P("fsdp", "tensor"), "w2": P("tensor", "fsdp"),
         "scale": P("fsdp"), "b": P()}
MESHES = [(2, 2, 2), (1, 4, 2)]


@pytest.fixture(autouse=True)
def standard_promotion():
  with jax.numpy_dtype_promotion("standard"):
    yield


def _mesh(shape):
  if jax.device_count() < int(np.prod(shape)):
    pytest.skip(f"needs {int(np.prod(shape))} devices")
  return jax.make_mesh(shape, ("data", "fsdp", "tensor"),
                       axis_types=(AxisType.Auto,) * 3)


def _params(mesh, specs=SPECS):
  rng = np.random.default_rng(0)
  host = {"w1": rng.normal(size=(D, H)) / np.sqrt(D),
          "w2": rng.normal(size=(H, D)) / np.sqrt(H),
          "scale": 1 + 0.1 * rng.normal(size=(D,)),
          "b": 0.1 * rng.normal(size=(D,))}
  return {k: jax.device_put(jnp.asarray(host[k], jnp.float32),
                            NamedSharding(mesh, specs[k])) for k in specs}


def _loss(p, batch):
  x, y = batch
  h = jax.nn.relu((x * p["scale"][None]) @ p["w1"])
  return jnp.mean((h @ p["w2"] + p["b"][None] - y) ** 2)


def _batch(mesh, seed=1, n=32):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(n, D)), jnp.float32)
  return jax.device_put((x, jnp.tanh(x)), NamedSharding(mesh, P(DATA)))


_plain, _compressed = gspmd_sgd_steps(_loss)


def _cost(compiled):
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, list) else ca
  return ca["flops"], compiled.memory_analysis().argument_size_in_bytes


def _axes_of(mesh, group) -> set:
  """The mesh axes a replica group spans (those its devices differ in)."""
  coords = {d.id: c for c, d in np.ndenumerate(mesh.devices)}
  at = [coords[i] for i in group]
  return {a for k, a in enumerate(mesh.axis_names) if len({c[k] for c in at}) > 1}


def _local_grad_bytes(params, mesh):
  """Float32 bytes of one device's gradient: whole over the data axes, its
  own shard over the tensor axis."""
  total = 0
  for k, x in params.items():
    n = x.size
    for e in SPECS[k]:
      names = () if e is None else (e,) if isinstance(e, str) else e
      n //= int(np.prod([mesh.shape[a] for a in names if a == "tensor"]))
    total += 4 * n
  return total


@pytest.mark.parametrize("shape", MESHES)
def test_identity_is_the_plain_gspmd_step(shape):
  mesh = _mesh(shape)
  params, batch = _params(mesh), _batch(mesh)
  grad_fn = jaxcomp.compressed_value_and_grad(
      _loss, jaxcomp.compressed_mean("identity", DATA), mesh, axis_name=DATA)
  state = grad_fn.init(params)
  step = _compressed(grad_fn)
  want, got = params, params
  for i in range(4):
    b = _batch(mesh, seed=i)
    want, want_loss = _plain(want, b)
    got, state, got_loss = step(got, state, b)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
  for k in params:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]),
                               rtol=1e-5, atol=1e-6)
    # The parameters keep their shardings (FSDP x tensor).
    assert got[k].sharding.is_equivalent_to(params[k].sharding, params[k].ndim), k
  # Per-device compute and inputs: the plain step's (no replicated compute,
  # no gathered copy kept as an argument).
  plain = _plain.lower(params, batch).compile()
  comp = step.lower(params, state, batch).compile()
  (pf, pa), (cf, ca) = _cost(plain), _cost(comp)
  assert cf <= 1.1 * pf, (cf, pf)
  assert ca <= 1.1 * pa, (ca, pa)
  # No extra all-gather: the parameters are gathered over fsdp no more than
  # the plain step gathers them, and never over the tensor axis.
  gathered = lambda c, axes: sum(
      op.operand_bytes for op in jaxcomp.collective_traffic(c).ops
      if op.kind == "all-gather" and _axes_of(mesh, op.replica_groups[0]) == axes)
  assert gathered(comp, {"fsdp"}) <= gathered(plain, {"fsdp"})
  assert gathered(comp, {"tensor"}) == gathered(plain, {"tensor"}) == 0


@pytest.mark.parametrize("shape", MESHES)
def test_int8_blocks_send_a_quarter_of_identitys_bytes(shape):
  mesh = _mesh(shape)
  params, batch = _params(mesh), _batch(mesh)

  def sent(name, **kw):
    grad_fn = jaxcomp.compressed_value_and_grad(
        _loss, jaxcomp.compressed_mean(name, DATA, **kw), mesh, axis_name=DATA)
    state = grad_fn.init(params)
    compiled = _compressed(grad_fn).lower(params, state, batch).compile()
    return jaxcomp.collective_traffic(compiled).operand_bytes, grad_fn, state

  dense, _, _ = sent("identity")
  int8, grad_fn, state = sent("int8_block")
  saved = dense - int8
  assert saved >= 2 / 3 * _local_grad_bytes(params, mesh), (dense, int8)
  # And it trains.
  step = _compressed(grad_fn)
  first = None
  for i in range(6):
    params, state, loss = step(params, state, _batch(mesh, seed=i % 2))
    first = float(loss) if first is None else first
  assert float(loss) < first


def test_refusals_name_the_leaf_and_the_fix():
  mesh = _mesh((2, 2, 2))
  def init(spec):
    x = jax.device_put(jnp.zeros((D, H), jnp.float32), NamedSharding(mesh, spec))
    grad_fn = jaxcomp.compressed_value_and_grad(
        lambda p, b: jnp.sum(p["w"]), jaxcomp.compressed_mean("identity", DATA),
        mesh, axis_name=DATA)
    return grad_fn.init({"w": x})
  with pytest.raises(ValueError, match=r"\['w'\] is sharded over data axes in two dimensions"):
    init(P("data", "fsdp"))
  with pytest.raises(ValueError, match=r"a model axis ahead of a data axis.*P\(\('fsdp', 'tensor'\)\)"):
    init(P(("tensor", "fsdp"), None))


def test_a_transform_that_cannot_reduce_scatter_is_refused_by_name():
  mesh = _mesh((2, 2, 2))
  params = _params(mesh)
  for tx, why in [(jaxcomp.compressed_mean("powersgd", DATA), "powersgd"),
                  (optax.chain(jaxcomp.compressed_mean("topk", DATA)),
                   "not a chain")]:
    grad_fn = jaxcomp.compressed_value_and_grad(_loss, tx, mesh, axis_name=DATA)
    with pytest.raises(ValueError, match=rf"sharded over the data axes \('fsdp',\).*{why}"):
      grad_fn.init(params)


class _MLP(nnx.Module):
  """The test's MLP as an NNX model whose parameters GSPMD shards as
  MaxText's NNX models are sharded (FSDP x tensor)."""

  def __init__(self, mesh):
    for k, v in _params(mesh).items():
      setattr(self, k, nnx.Param(v))
    self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))

  def __call__(self, x):
    h = jax.nn.relu((x * self.scale[...][None]) @ self.w1[...])
    return h @ self.w2[...] + self.b[...][None]


def _nnx_loss(model, batch):
  x, y = batch
  return jnp.mean((model(x) - y) ** 2)


def _nnx_step(grad_fn):
  @nnx.jit
  def step(model, optimizer, comp_state, batch):
    (loss, grads), comp_state = grad_fn(model, comp_state, batch)
    optimizer.update(model, grads)
    return loss, comp_state
  return step


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("compressor", ["identity", "int8_block"])
def test_nnx_route_is_the_functional_route(shape, compressor):
  """jaxcomp.flax.ValueAndGrad on an nnx.Module with FSDP x tensor
  parameters, stepped by a plain nnx.Optimizer in nnx.jit, gives the
  functional route's parameters bit for bit (and with identity the plain
  GSPMD step's); the parameters keep their shardings."""
  mesh = _mesh(shape)
  model = _MLP(mesh)
  tx = jaxcomp.compressed_mean(compressor, DATA)
  grad_fn = jaxcomp.flax.ValueAndGrad(_nnx_loss, tx, mesh, axis_name=DATA)
  comp_state = grad_fn.init(model)
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  step = _nnx_step(grad_fn)
  functional = jaxcomp.compressed_value_and_grad(_loss, tx, mesh, axis_name=DATA)
  params = _params(mesh)
  f_state = functional.init(params)
  f_step = _compressed(functional)
  plain = _params(mesh)
  for i in range(3):
    b = _batch(mesh, seed=i)
    loss, comp_state = step(model, optimizer, comp_state, b)
    params, f_state, f_loss = f_step(params, f_state, b)
    plain, _ = _plain(plain, b)
    assert float(loss) == float(f_loss)
  for k in SPECS:
    got = getattr(model, k)[...]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(params[k]))
    if compressor == "identity":
      np.testing.assert_allclose(np.asarray(got), np.asarray(plain[k]),
                                 rtol=1e-5, atol=1e-6)
    assert got.sharding.is_equivalent_to(params[k].sharding, got.ndim), k


def test_nnx_route_refuses_a_loss_that_changes_other_variables():
  """The route reads the model's other variables; a loss that updates one
  (a counter here, BatchNorm statistics in a real model) is refused when
  traced, by name, instead of losing the update."""
  mesh = _mesh(MESHES[0])
  model = _MLP(mesh)

  def counting(model, batch):
    model.calls[...] += 1
    return _nnx_loss(model, batch)

  grad_fn = jaxcomp.flax.ValueAndGrad(
      counting, jaxcomp.compressed_mean("identity", DATA), mesh, axis_name=DATA)
  comp_state = grad_fn.init(model)
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  with pytest.raises(ValueError, match=r"changed the model's variables.*calls"):
    _nnx_step(grad_fn)(model, optimizer, comp_state, _batch(mesh))
