"""DiLoCo across islands: exact data parallelism inside each island of
devices ("data"), DiLoCo's compressed exchange across islands ("hosts")."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomp
from jaxcomp import lowcomm
from tests.test_lowcomm import _loss, _params  # the same model and loss

AXES = ("hosts", "data")


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
  local, st, specs = lowcomm.init(tx, _params(), mesh, AXES,
                                  copies_over="hosts")
  step = lowcomm.make_train_step(_loss, tx, mesh=mesh, state_specs=specs,
                                 axis_name=AXES, per_device_loss=True,
                                 donate=False, copies_over="hosts")
  return local, st, step


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
  local, st, step = _setup(tx, mesh24)
  ref = jax.device_get(_params())
  for batch in _batches(mesh24, 4):
    local, st, _ = step(local, st, batch)
    g = jax.grad(_loss)(ref, jax.device_get(batch))
    ref = jax.tree.map(lambda p, g: p - 0.1 * g, ref, g)
  anchor = lowcomm.synced_params(st)
  for k in ref:
    np.testing.assert_allclose(np.asarray(anchor[k]), ref[k], rtol=2e-6, atol=2e-7)
    copies = _copies(local)[k]
    np.testing.assert_array_equal(copies, np.broadcast_to(copies[:1, :1], copies.shape))


@pytest.mark.parametrize("compressor,kw", [("identity", {}),
                                           ("int8_block", {"bits": 4})])
def test_devices_in_an_island_stay_equal_and_islands_meet_at_each_sync(
    mesh24, compressor, kw):
  h = 3
  tx = _islands_tx(optax.sgd(0.3, momentum=0.9), sync_every=h,
                   compressor=compressor, **kw)
  local, st, step = _setup(tx, mesh24)
  for i, batch in enumerate(_batches(mesh24, 7)):
    local, st, _ = step(local, st, batch)
    for k, c in _copies(local).items():
      # Exact data parallelism inside an island: equal bit for bit.
      np.testing.assert_array_equal(c, np.broadcast_to(c[:, :1], c.shape))
      if (i + 1) % h == 0:  # a sync: every device on the new anchor
        np.testing.assert_array_equal(c, np.broadcast_to(
            np.asarray(lowcomm.synced_params(st)[k])[None, None], c.shape))
      else:  # the islands' data differ, and so do their parameters
        assert np.abs(c[0, 0] - c[1, 0]).max() > 1e-4, (i, k)


def _groups_of(op):
  return {frozenset(g) for g in op.replica_groups}


def test_collectives_cross_islands_only_in_the_sync_branch(mesh24):
  tx = _islands_tx(optax.sgd(0.1), sync_every=4, compressor="int8_block", bits=4)
  local, st, step = _setup(tx, mesh24)
  batch = _batches(mesh24, 1)[0]
  traffic = jaxcomp.collective_traffic(step.lower(local, st, batch).compile())
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


def test_resume_mid_interval_is_bit_exact(mesh24, tmp_path):
  tx = _islands_tx(optax.sgd(0.1, momentum=0.9), sync_every=3,
                   compressor="topk", ratio=0.2, fragments=2)
  local, st, step = _setup(tx, mesh24)
  batches = _batches(mesh24, 6)
  for b in batches[:2]:
    local, st, _ = step(local, st, b)
  ckpt = jaxcomp.checkpoint.Checkpointer(tmp_path)
  ckpt.save(2, {"params": local, "opt_state": st})
  a, a_st = local, st
  for b in batches[2:]:
    a, a_st, _ = step(a, a_st, b)
  fresh, fresh_st, _ = _setup(tx, mesh24)
  _, restored = ckpt.restore({"params": fresh, "opt_state": fresh_st})
  r, r_st = restored["params"], restored["opt_state"]
  for b in batches[2:]:
    r, r_st, _ = step(r, r_st, b)
  for x, y in zip(jax.tree.leaves((a, a_st)), jax.tree.leaves((r, r_st))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_islands_refuse_what_would_split_an_island(mesh24):
  # Without the exact mean inside the island, its devices' copies would
  # drift apart: refused at the first trace, naming the fix.
  tx = jaxcomp.diloco(optax.sgd(0.1), sync_every=2, axis_name="hosts")
  local, st, specs = lowcomm.init(tx, _params(), mesh24, AXES, copies_over="hosts")
  step = lowcomm.make_train_step(_loss, tx, mesh=mesh24, state_specs=specs,
                                 axis_name=AXES, copies_over="hosts")
  with pytest.raises(ValueError, match=r"compressed_mean\('identity', \('data',\)\)"):
    step(local, st, _batches(mesh24, 1)[0])
  with pytest.raises(ValueError, match="copies' axes over='model'"):
    lowcomm.init(tx, _params(), mesh24, AXES, copies_over="model")


def test_streaming_fragments_with_delayed_landing_keep_islands_whole(mesh24):
  tx = _islands_tx(optax.sgd(0.3), sync_every=4, fragments=2, overlap_steps=1,
                   compressor="int8_block", bits=4)
  local, st, step = _setup(tx, mesh24)
  for batch in _batches(mesh24, 9):
    local, st, _ = step(local, st, batch)
    for c in _copies(local).values():
      np.testing.assert_array_equal(c, np.broadcast_to(c[:, :1], c.shape))
  assert np.isfinite(np.asarray(jax.tree.leaves(local)[0])).all()
