"""The jax.jit idiom on parameters GSPMD shards over model axes (tensor
parallelism, the loss written for global arrays): compression over the data
axes only, on each device's local shards, with the uncompressed step's
per-device compute, memory and model-axis collectives, all read from the
compiled modules."""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import numpy as np
import pytest

import jaxcomp
from tests.helpers import gspmd_sgd_steps
from jaxcomp import compressors

D, H = 64, 256
SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None),
         "b2": P()}


@pytest.fixture(autouse=True)
def standard_promotion():
  # optax.adam mixes int32 counts and floats, which strict promotion rejects.
  with jax.numpy_dtype_promotion("standard"):
    yield


def _mesh(shape, names):
  if jax.device_count() < int(np.prod(shape)):
    pytest.skip(f"needs {int(np.prod(shape))} devices")
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _params(mesh):
  rng = np.random.default_rng(0)
  host = {"w1": rng.normal(size=(D, H)) / np.sqrt(D),
          "b1": rng.normal(size=(H,)) * 0.1,
          "w2": rng.normal(size=(H, D)) / np.sqrt(H),
          "b2": rng.normal(size=(D,)) * 0.1}
  return {k: jax.device_put(jnp.asarray(v, jnp.float32),
                            NamedSharding(mesh, SPECS[k]))
          for k, v in host.items()}


def _loss(p, batch):
  x, y = batch
  h = jax.nn.relu(x @ p["w1"] + p["b1"][None])
  return jnp.mean((h @ p["w2"] + p["b2"][None] - y) ** 2)


def _batch(mesh, data, n=64, seed=1):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(n, D)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(n, D)), jnp.float32)
  return jax.device_put((x, y), NamedSharding(mesh, P(data)))


_plain, _compressed = gspmd_sgd_steps(_loss)


def _cost(compiled):
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, list) else ca
  return ca["flops"], compiled.memory_analysis().argument_size_in_bytes


def _model_groups(mesh, model_axes):
  """The device-id groups of collectives over the model axes."""
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  names = list(mesh.axis_names)
  keep = [names.index(a) for a in model_axes]
  rest = [i for i in range(len(names)) if i not in keep]
  groups = ids.transpose(rest + keep).reshape(-1, int(np.prod(
      [ids.shape[i] for i in keep])))
  return {tuple(sorted(g)) for g in groups.tolist()}


def _gathered_over(traffic, groups):
  return sum(op.operand_bytes for op in traffic.ops if op.kind == "all-gather"
             and op.replica_groups and {tuple(sorted(g)) for g in op.replica_groups} <= groups)


@pytest.mark.parametrize("shape,names,data", [
    ((4, 2), ("data", "model"), "data"),
    ((2, 2, 2), ("pod", "data", "model"), ("pod", "data")),
])
def test_identity_is_the_plain_gspmd_step(shape, names, data):
  mesh = _mesh(shape, names)
  params, batch = _params(mesh), _batch(mesh, data)
  grad_fn = jaxcomp.compressed_value_and_grad(
      _loss, jaxcomp.compressed_mean("identity", data), mesh, axis_name=data)
  state = grad_fn.init(params)
  step = _compressed(grad_fn)
  want_params, want_loss = _plain(params, batch)
  got_params, state, got_loss = step(params, state, batch)
  assert float(got_loss) == float(want_loss)
  for k in params:
    np.testing.assert_allclose(np.asarray(got_params[k]),
                               np.asarray(want_params[k]), rtol=0, atol=1e-7)
    # The update keeps the parameters' shardings (tensor parallelism).
    assert got_params[k].sharding.is_equivalent_to(
        params[k].sharding, params[k].ndim), k
  # Per-device compute and memory are the plain step's, not the model's
  # whole (the silent failure: every device ran the whole MLP).
  plain = _plain.lower(params, batch).compile()
  comp = step.lower(params, state, batch).compile()
  (pf, pa), (cf, ca) = _cost(plain), _cost(comp)
  # At most one elementwise op per element of the local gradient (the
  # mean's 1/n, which XLA 0.12 counts apart from the all-reduce; 0.10.2
  # counts none): ~1.2% of this small model's step, nothing model-sized.
  local = sum(x.addressable_shards[0].data.size for x in params.values())
  assert cf <= pf + local + 16, (cf, pf, local)
  assert ca - pa <= 256, (ca, pa)  # the transform's count, key, statistics
  # The same collectives: the model axis's activation all-reduce and the
  # data axis's gradient all-reduce, nothing gathered.
  ops = lambda c: sorted((o.kind, o.operand_bytes, o.group_size)
                         for o in jaxcomp.collective_traffic(c).ops)
  assert ops(comp) == ops(plain)
  groups = _model_groups(mesh, ["model"])
  assert _gathered_over(jaxcomp.collective_traffic(comp), groups) == 0


def test_topk_compresses_each_local_shard_over_the_data_axis():
  mesh = _mesh((4, 2), ("data", "model"))
  params, batch = _params(mesh), _batch(mesh, "data")
  ratio = 0.05
  # One bucket per leaf: each local shard's own top-k (the default "auto"
  # packs these small leaves together).
  grad_fn = jaxcomp.compressed_value_and_grad(
      _loss, jaxcomp.compressed_mean("topk", "data", ratio=ratio,
                                     bucketing="layerwise"), mesh)
  state = grad_fn.init(params)
  step = _compressed(grad_fn)
  comp = step.lower(params, state, batch).compile()
  traffic = jaxcomp.collective_traffic(comp)
  data_groups = _model_groups(mesh, ["data"])
  gathered = sum(op.operand_bytes for op in traffic.ops
                 if op.kind == "all-gather"
                 and {tuple(sorted(g)) for g in op.replica_groups} <= data_groups)
  topk = compressors.get("topk", ratio=ratio)
  local = {"w1": D * H // 2, "b1": H // 2, "w2": H // 2 * D, "b2": D}
  assert gathered == sum(topk.payload_bytes(n) for n in local.values())
  # Nothing gathered over the model axis for compression.
  groups = _model_groups(mesh, ["model"])
  assert _gathered_over(traffic, groups) == 0
  # The residual is per device and per model shard: w1's local (64, 128).
  w1 = sorted(params).index("w1")  # jax.tree.leaves order of a dict
  assert state.feedback[w1][0].shape == (8, D * H // 2)
  # It trains.
  losses = []
  for i in range(30):
    params, state, loss = step(params, state, _batch(mesh, "data", seed=i % 3))
    losses.append(float(loss))
  assert losses[-1] < 0.8 * losses[0]
  assert params["w1"].sharding.is_equivalent_to(
      NamedSharding(mesh, SPECS["w1"]), 2)


def test_a_parameter_sharded_over_the_data_axis_trains_as_the_plain_step():
  # Once refused by name; now the leaf's gradient is reduce-scattered over
  # the data axis into its blocks (tests/test_fsdp_tp.py has the rest).
  mesh = _mesh((4, 2), ("data", "model"))
  params, batch = _params(mesh), _batch(mesh, "data")
  params["w2"] = jax.device_put(params["w2"],
                                NamedSharding(mesh, P("model", "data")))
  grad_fn = jaxcomp.compressed_value_and_grad(
      _loss, jaxcomp.compressed_mean("identity", "data"), mesh)
  state = grad_fn.init(params)
  got_params, state, got_loss = _compressed(grad_fn)(params, state, batch)
  want_params, want_loss = _plain(params, batch)
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
  for k in params:
    np.testing.assert_allclose(np.asarray(got_params[k]),
                               np.asarray(want_params[k]), rtol=0, atol=1e-7)
    assert got_params[k].sharding.is_equivalent_to(
        params[k].sharding, params[k].ndim), k


def test_a_constraint_naming_the_data_axis_says_what_to_write():
  mesh = _mesh((4, 2), ("data", "model"))
  params, batch = _params(mesh), _batch(mesh, "data")

  def loss(p, batch):
    x, y = batch
    h = jax.nn.relu(x @ p["w1"] + p["b1"][None])
    h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh,
                                                          P("data", "model")))
    return jnp.mean((h @ p["w2"] + p["b2"][None] - y) ** 2)

  grad_fn = jaxcomp.compressed_value_and_grad(
      loss, jaxcomp.compressed_mean("identity", "data"), mesh)
  state = grad_fn.init(params)
  with pytest.raises(ValueError, match=r"P\(None, 'model'\)"):
    jax.jit(grad_fn)(params, state, batch)


_ONE_DEVICE = r"""
import sys, warnings
import jax
if sys.argv[1] == "drop":
  jax.config.update("jax_remove_size_one_mesh_axis_from_type", True)
import jax.numpy as jnp, optax, jaxcomp
from jax.sharding import NamedSharding, PartitionSpec as P
warnings.simplefilter("error")
mesh = jax.make_mesh((1,), ("data",))
params = {"w": jnp.ones((16, 8)), "b": jnp.zeros(8)}
def loss_fn(p, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)
tx = optax.chain(jaxcomp.compressed_mean("identity", "data"), optax.sgd(0.1))
st = jaxcomp.init(tx, params, mesh)
step = jaxcomp.make_train_step(loss_fn, tx, mesh=mesh)
batch = jax.device_put((jnp.ones((8, 16)), jnp.ones((8, 8))),
                       NamedSharding(mesh, P("data")))
ops = jaxcomp.collective_traffic(step.lower(st, batch).compile()).ops
print(sorted((o.kind, o.group_size) for o in ops))
"""


@pytest.mark.parametrize("mode,want", [
    ("drop", "[]"),                          # the plain step's: none
    ("keep", "[('all-reduce', 1)]"),         # JAX's default: over one device
])
def test_identity_on_one_device_under_jaxs_size_one_axis_flag(mode, want):
  """On one device, with JAX's jax_remove_size_one_mesh_axis_from_type,
  compression switched off compiles to no collective at all, as the plain
  step (and no warning); by default JAX keeps an all-reduce over the one
  device (docs/codec_speed.md)."""
  import os
  import subprocess
  import sys
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  out = subprocess.run([sys.executable, "-c", _ONE_DEVICE, mode], env=env,
                       capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == want
