"""DiLoCo across islands: exact data parallelism inside each island of
devices ("data"), DiLoCo's compressed exchange across islands ("hosts")."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomp
from jaxcomp import lowcomm
from tests.test_lowcomm import _loss, _params  # the same model and loss

AXES = ("hosts", "data")
ISLANDS = jaxcomp.Islands(over="hosts")  # one copy per island of "data" devices


@pytest.fixture
def mesh24():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  return jax.make_mesh((2, 4), AXES)


def _batches(mesh, n):
  out = []
  for i in range(n):
    k1, k2 = jax.random.split(jax.random.key(100 + i))
    xy = (jax.random.normal(k1, (64, 13)), jax.random.normal(k2, (64, 7)))
    out.append(jax.device_put(xy, NamedSharding(mesh, P(AXES))))
  return out


def _islands_tx(inner, *, sync_every, **kwargs):
  """The recipe: the inner optimizer averages each island's gradients
  exactly over "data"; DiLoCo exchanges pseudo-gradients over "hosts"."""
  return jaxcomp.diloco(
      optax.chain(jaxcomp.compressed_mean("identity", "data"), inner),
      sync_every=sync_every, axis_name="hosts", **kwargs)


def _setup(tx, mesh):
  state = jaxcomp.init(tx, _params(), mesh, layout=ISLANDS, axis_name=AXES)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh, layout=ISLANDS,
                                 axis_name=AXES, per_device_loss=True,
                                 donate=False)
  return state, step


def _copies(tree):
  """Each device's copy, as numpy: (islands, devices per island, ...)."""
  out = {}
  for k, v in tree.items():
    assert v.shape[0] == 2, v.shape  # one copy per island
    # Read every device's buffer: the copies inside an island must agree.
    shards = sorted(v.addressable_shards, key=lambda s: s.device.id)
    out[k] = np.stack([np.asarray(s.data)[0] for s in shards]).reshape(
        2, 4, *v.shape[1:])
  return out


def test_one_step_intervals_with_unit_outer_sgd_are_data_parallel_sgd(mesh24):
  # H = 1, identity, outer SGD(1.0): the anchor moves by the mean over the
  # islands of each island's exact mean gradient, i.e. by the gradient of
  # the whole batch: data-parallel SGD over all 8 devices.
  tx = _islands_tx(optax.sgd(0.1), sync_every=1, outer=optax.sgd(1.0))
  state, step = _setup(tx, mesh24)
  ref = jax.device_get(_params())
  for batch in _batches(mesh24, 4):
    state, _ = step(state, batch)
    g = jax.grad(_loss)(ref, jax.device_get(batch))
    ref = jax.tree.map(lambda p, g: p - 0.1 * g, ref, g)
  anchor = lowcomm.synced_params(state.opt_state)
  for k in ref:
    np.testing.assert_allclose(np.asarray(anchor[k]), ref[k], rtol=2e-6, atol=2e-7)
    copies = _copies(state.params)[k]
    np.testing.assert_array_equal(copies, np.broadcast_to(copies[:1, :1], copies.shape))


@pytest.mark.parametrize("compressor,kw", [("identity", {}),
                                           ("int8_block", {"bits": 4})])
def test_devices_in_an_island_stay_equal_and_islands_meet_at_each_sync(
    mesh24, compressor, kw):
  h = 3
  tx = _islands_tx(optax.sgd(0.3, momentum=0.9), sync_every=h,
                   compressor=compressor, **kw)
  state, step = _setup(tx, mesh24)
  for i, batch in enumerate(_batches(mesh24, 7)):
    state, _ = step(state, batch)
    for k, c in _copies(state.params).items():
      # Exact data parallelism inside an island: equal bit for bit.
      np.testing.assert_array_equal(c, np.broadcast_to(c[:, :1], c.shape))
      if (i + 1) % h == 0:  # a sync: every device on the new anchor
        np.testing.assert_array_equal(c, np.broadcast_to(
            np.asarray(lowcomm.synced_params(state.opt_state)[k])[None, None], c.shape))
      else:  # the islands' data differ, and so do their parameters
        assert np.abs(c[0, 0] - c[1, 0]).max() > 1e-4, (i, k)


def _groups_of(op):
  return {frozenset(g) for g in op.replica_groups}


def test_collectives_cross_islands_only_in_the_sync_branch(mesh24):
  tx = _islands_tx(optax.sgd(0.1), sync_every=4, compressor="int8_block", bits=4)
  state, step = _setup(tx, mesh24)
  batch = _batches(mesh24, 1)[0]
  traffic = jaxcomp.collective_traffic(step.lower(state, batch).compile())
  # Replica groups count devices in the mesh's order: island i is 4i..4i+3.
  island = [frozenset(range(4 * i, 4 * i + 4)) for i in range(2)]
  n = sum(x.size for x in jax.tree.leaves(_params()))
  inner = [o for o in traffic.ops if not o.in_branch]
  # Every step: the exact gradient mean inside each island, nothing across.
  assert inner and all(_groups_of(o) == set(island) for o in inner), inner
  assert sum(o.operand_bytes for o in inner) == 4 * n
  crossing = [o for o in traffic.ops
              if any(not any(grp <= isl for isl in island)
                     for grp in _groups_of(o))]
  assert crossing and all(o.in_branch for o in crossing), crossing


def _assert_resumes_bit_exactly(setup, batches, tmp_path):
  """Two steps, an Orbax checkpoint, the rest of ``batches`` from it and
  from a fresh placement restored from it: equal bit for bit. ``setup()``
  returns ``(state, step)``."""
  state, step = setup()
  for b in batches[:2]:
    state, _ = step(state, b)
  ckpt = jaxcomp.checkpoint.Checkpointer(tmp_path)
  ckpt.save(2, {"params": state.params, "opt_state": state.opt_state})
  a = state
  for b in batches[2:]:
    a, _ = step(a, b)
  fresh, _ = setup()
  _, restored = ckpt.restore({"params": fresh.params, "opt_state": fresh.opt_state})
  r = dataclasses.replace(fresh, params=restored["params"],
                          opt_state=restored["opt_state"])
  for b in batches[2:]:
    r, _ = step(r, b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(r)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resume_mid_interval_is_bit_exact(mesh24, tmp_path):
  tx = _islands_tx(optax.sgd(0.1, momentum=0.9), sync_every=3,
                   compressor="topk", ratio=0.2, fragments=2)
  _assert_resumes_bit_exactly(lambda: _setup(tx, mesh24), _batches(mesh24, 6),
                              tmp_path)


def test_islands_refuse_what_would_split_an_island(mesh24):
  # Without the exact mean inside the island, its devices' copies would
  # drift apart: refused at the first trace, naming the fix.
  tx = jaxcomp.diloco(optax.sgd(0.1), sync_every=2, axis_name="hosts")
  state = jaxcomp.init(tx, _params(), mesh24, layout=ISLANDS, axis_name=AXES)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh24, layout=ISLANDS, axis_name=AXES)
  with pytest.raises(ValueError, match=r"compressed_mean\('identity', \('data',\)\)"):
    step(state, _batches(mesh24, 1)[0])
  with pytest.raises(ValueError, match="copies' axes over='model'"):
    jaxcomp.init(tx, _params(), mesh24, layout=jaxcomp.Islands(over="model"), axis_name=AXES)


def test_streaming_fragments_with_delayed_landing_keep_islands_whole(mesh24):
  tx = _islands_tx(optax.sgd(0.3), sync_every=4, fragments=2, overlap_steps=1,
                   compressor="int8_block", bits=4)
  state, step = _setup(tx, mesh24)
  for batch in _batches(mesh24, 9):
    state, _ = step(state, batch)
    for c in _copies(state.params).values():
      np.testing.assert_array_equal(c, np.broadcast_to(c[:, :1], c.shape))
  assert np.isfinite(np.asarray(jax.tree.leaves(state.params)[0])).all()


# -- Islands in the user's idioms: a jit step, NNX ---------------------------


def _functional_run(tx, mesh, batches):
  state, step = _setup(tx, mesh)
  hist = []
  for b in batches:
    state, loss = step(state, b)
    hist.append((jax.device_get(state.params), jax.device_get(state.model_params()),
                 np.asarray(loss)))
  return state.opt_state, hist


def test_the_islands_step_inside_a_users_jit_step_is_the_step(mesh24):
  """make_train_step's islands step called inside the user's own jax.jit
  step runs what it compiles alone, bit for bit."""
  tx = _islands_tx(optax.sgd(0.2, momentum=0.9), sync_every=2,
                   compressor="int8_block", bits=4)
  batches = _batches(mesh24, 5)
  ref_st, hist = _functional_run(tx, mesh24, batches)
  inner = jaxcomp.make_train_step(_loss, tx, mesh=mesh24, layout=ISLANDS, axis_name=AXES,
                                  per_device_loss=True, donate=False)
  state = jaxcomp.init(tx, _params(), mesh24, layout=ISLANDS, axis_name=AXES)
  assert jax.tree.leaves(state.params)[0].shape[0] == 2  # one copy per island

  @jax.jit
  def train_step(state, batch):
    state, loss = inner(state, batch)
    return state, loss, state.model_params()

  for b, (ref_local, ref_anchor, ref_loss) in zip(batches, hist):
    state, loss, anchor = train_step(state, b)
    for k in ref_local:
      np.testing.assert_array_equal(np.asarray(state.params[k]), ref_local[k])
      np.testing.assert_array_equal(np.asarray(anchor[k]), ref_anchor[k])
    np.testing.assert_array_equal(np.asarray(loss), ref_loss)
  for x, y in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(ref_st)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_nnx_optimizer_with_islands_trains_as_the_functional_step(mesh24):
  """jaxcomp.flax.Optimizer(layout=jaxcomp.Islands(over="hosts")): one copy
  per island in optimizer.local, the model on the synchronized parameters,
  both as jaxcomp.make_train_step computes them for the same function."""
  from flax import nnx
  import jaxcomp.flax
  from tests.test_lowcomm import _nnx_loss, _nnx_model, _nnx_step_as_functional
  tx = _islands_tx(optax.sgd(0.2, momentum=0.9), sync_every=2,
                   compressor="int8_block", bits=4)
  model = _nnx_model()
  graphdef, params0 = nnx.split(model, nnx.Param)
  params0 = nnx.as_pure(params0)
  opt = jaxcomp.flax.Optimizer(model, tx, wrt=nnx.Param, mesh=mesh24,
                               axis_name=AXES, layout=ISLANDS)
  assert opt.local["lin"]["kernel"][...].shape == (2, 13, 7)
  step = jaxcomp.flax.train_step(_nnx_loss)
  fn_loss = lambda p, b: _nnx_loss(nnx.merge(graphdef, p), b)
  ref = jaxcomp.init(tx, params0, mesh24, layout=ISLANDS, axis_name=AXES)
  ref_step = jaxcomp.make_train_step(fn_loss, tx, mesh=mesh24, layout=ISLANDS,
                                     axis_name=AXES)
  for i, b in enumerate(_batches(mesh24, 4)):
    ref, w_local, _ = _nnx_step_as_functional(step, model, opt, ref_step, ref, b)
    # The islands meet at each sync and differ between syncs.
    assert np.array_equal(w_local[0], w_local[1]) == ((i + 1) % 2 == 0), i
  with pytest.raises(ValueError, match="islands with FSDP inside need jaxcomp.init"):
    jaxcomp.flax.Optimizer(_nnx_model(), tx, wrt=nnx.Param, mesh=mesh24, axis_name=AXES,
                           layout=jaxcomp.Islands(over="hosts",
                                                  inside=jaxcomp.FSDP(shard_axis="data")))
  with pytest.raises(ValueError, match="only jaxcomp.diloco in tx synchronizes"):
    jaxcomp.flax.Optimizer(
        _nnx_model(), optax.chain(jaxcomp.compressed_mean("identity", AXES),
                                  optax.sgd(0.1)),
        wrt=nnx.Param, mesh=mesh24, axis_name=AXES, layout=ISLANDS)


# -- FSDP inside each island -------------------------------------------------


def _fsdp_islands_tx(inner, *, sync_every, **kwargs):
  """Each island shards its copy over "data" (the gradient reduce-scattered
  exactly there); DiLoCo exchanges each device's pseudo-gradient shard
  over "hosts"."""
  return jaxcomp.diloco(
      optax.chain(jaxcomp.compressed_mean("identity", "data", output="shard"),
                  inner),
      sync_every=sync_every, axis_name="hosts", **kwargs)


FSDP_ISLANDS = jaxcomp.Islands(over="hosts", inside=jaxcomp.FSDP(shard_axis="data"))


def _fsdp_setup(tx, mesh):
  state = jaxcomp.init(tx, _params(), mesh, layout=FSDP_ISLANDS, axis_name=AXES)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh, layout=FSDP_ISLANDS,
                                 axis_name=AXES, per_device_loss=True, donate=False)
  return state, step


def _whole_copies(local, shapes):
  """Each island's copy made whole: {name: (islands, *shape)}."""
  out = {}
  for k, s in shapes.items():
    x = np.asarray(jax.device_get(local[k]))
    n = int(np.prod(s.shape))
    out[k] = x[:, :n].reshape(x.shape[0], *s.shape)
  return out


def test_fsdp_islands_train_as_replicated_islands(mesh24):
  """FSDP inside each island computes what the replicated islands compute
  (the same gradients, reduce-scattered instead of all-reduced), with and
  without a sync in the interval, while each device holds a quarter."""
  from jaxcomp import fsdp
  kw = dict(sync_every=3, outer=optax.sgd(0.7, momentum=0.5, nesterov=True))
  state, step = _fsdp_setup(_fsdp_islands_tx(optax.sgd(0.2, momentum=0.9), **kw), mesh24)
  ref, ref_step = _setup(_islands_tx(optax.sgd(0.2, momentum=0.9), **kw), mesh24)
  shapes = state.layout.inside.shapes
  n = {k: int(np.prod(s.shape)) for k, s in shapes.items()}
  for k, x in state.params.items():  # (islands, p * c): a quarter per device
    assert x.shape[0] == 2
    assert x.addressable_shards[0].data.shape == (1, -(-n[k] // 4))
  for i, batch in enumerate(_batches(mesh24, 7)):
    state, loss = step(state, batch)
    ref, ref_loss = ref_step(ref, batch)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(ref_loss), rtol=1e-5)
    whole = _whole_copies(state.params, shapes)
    for k in whole:
      np.testing.assert_allclose(whole[k], _copies(ref.params)[k][:, 0],
                                 rtol=2e-5, atol=2e-6)
    anchor = fsdp.unshard_params(lowcomm.synced_params(state.opt_state), shapes)
    for k in anchor:
      np.testing.assert_allclose(np.asarray(anchor[k]),
                                 np.asarray(lowcomm.synced_params(ref.opt_state)[k]),
                                 rtol=2e-5, atol=2e-6)
      if (i + 1) % 3 == 0:  # a sync: both islands on the anchor, exactly
        np.testing.assert_array_equal(whole[k][0], whole[k][1])
        np.testing.assert_array_equal(whole[k][0], np.asarray(anchor[k]))


def test_fsdp_islands_streaming_fragments_as_replicated_islands(mesh24):
  """Streaming DiLoCo's fragments with a delayed landing, FSDP inside each
  island: what the replicated islands compute, within float rounding."""
  from jaxcomp import fsdp
  kw = dict(sync_every=4, fragments=2, overlap_steps=1)
  state, step = _fsdp_setup(_fsdp_islands_tx(optax.sgd(0.3), **kw), mesh24)
  ref, ref_step = _setup(_islands_tx(optax.sgd(0.3), **kw), mesh24)
  for batch in _batches(mesh24, 9):
    state, _ = step(state, batch)
    ref, _ = ref_step(ref, batch)
  shapes = state.layout.inside.shapes
  whole = _whole_copies(state.params, shapes)
  anchor = fsdp.unshard_params(lowcomm.synced_params(state.opt_state), shapes)
  for k in whole:
    np.testing.assert_allclose(whole[k], _copies(ref.params)[k][:, 0],
                               rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(anchor[k]),
                               np.asarray(lowcomm.synced_params(ref.opt_state)[k]),
                               rtol=2e-5, atol=2e-6)


def test_fsdp_islands_cross_hosts_only_in_the_sync_branch(mesh24):
  """Every step: the parameters' all-gather and the gradient's
  reduce-scatter inside each island; across islands, only each device's
  compressed shard of the pseudo-gradient, inside the sync's branch."""
  tx = _fsdp_islands_tx(optax.sgd(0.1), sync_every=4, compressor="int8_block",
                        bits=4)
  state, step = _fsdp_setup(tx, mesh24)
  batch = _batches(mesh24, 1)[0]
  traffic = jaxcomp.collective_traffic(step.lower(state, batch).compile())
  island = [frozenset(range(4 * i, 4 * i + 4)) for i in range(2)]
  inner = [o for o in traffic.ops if not o.in_branch]
  assert {o.kind for o in inner} >= {"all-gather", "reduce-scatter"}, inner
  assert all(_groups_of(o) == set(island) for o in inner), inner
  crossing = [o for o in traffic.ops
              if any(not any(grp <= isl for isl in island)
                     for grp in _groups_of(o))]
  assert crossing and all(o.in_branch for o in crossing), crossing
  # Each device sends its own shard's payload, not the whole model's: a
  # quarter of what the replicated islands send across, up to the blocks'
  # scales and the shards' padding.
  r_state, r_step = _setup(
      _islands_tx(optax.sgd(0.1), sync_every=4, compressor="int8_block", bits=4),
      mesh24)
  r_traffic = jaxcomp.collective_traffic(r_step.lower(r_state, batch).compile())
  across = lambda t: sum(o.operand_bytes for o in t.ops if any(
      not any(grp <= isl for isl in island) for grp in _groups_of(o)))
  assert 0 < across(traffic) <= across(r_traffic) / 2


def test_fsdp_islands_resume_mid_interval_bit_exactly(mesh24, tmp_path):
  tx = _fsdp_islands_tx(optax.sgd(0.1, momentum=0.9), sync_every=3, compressor="topk",
                        ratio=0.2)
  _assert_resumes_bit_exactly(lambda: _fsdp_setup(tx, mesh24), _batches(mesh24, 5),
                              tmp_path)


def test_fsdp_islands_refuse_what_cannot_work(mesh24):
  tx = _fsdp_islands_tx(optax.sgd(0.1), sync_every=2)
  with pytest.raises(ValueError, match=r"layout=jaxcomp\.Islands\(\s*over="):
    jaxcomp.init(tx, _params(), mesh24, layout=jaxcomp.FSDP(shard_axis="data"),
                 axis_name=AXES)
  with pytest.raises(ValueError, match="apart from the islands' axes"):
    jaxcomp.init(tx, _params(), mesh24, axis_name=AXES, layout=jaxcomp.Islands(
        over="hosts", inside=jaxcomp.FSDP(shard_axis="hosts")))
