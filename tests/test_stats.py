"""Statistics users can trust ([integration] item 7): operand and wire
bytes, each against the dense all-reduce, read back from the compiled
step; every compressed_mean of a state counted."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from tests.helpers import sharded_update, stacked

N = 100_000


def _step_traffic(tx, mesh, params):
  f, state, _ = sharded_update(tx, params, mesh)
  g = stacked(jax.tree.map(lambda p: jnp.ones((8, *p.shape)), params), mesh)
  traffic = jaxcomp.collective_traffic(f.lower(g, state).compile())
  return jaxcomp.get_stats(state), traffic


@pytest.mark.parametrize("kwargs,wire_factor", [
    ({"ratio": 0.01}, 12.5),  # 7/4 n dense against 7 * 8k top-k, k = n/100
    ({"ratio": 0.01, "max_ratio": 0.1}, 1.25),  # a schedule sends capacity
])
def test_topk_wire_bytes_on_8_devices(mesh8, kwargs, wire_factor):
  stats, traffic = _step_traffic(
      jaxcomp.compressed_mean("topk", "data", **kwargs), mesh8,
      {"w": jnp.zeros((N,))})
  # Operand bytes count as before: 8 k bytes against 4 n.
  k = int(np.ceil(kwargs.get("max_ratio", kwargs["ratio"]) * N))
  assert float(stats.bytes_sent) == 8 * k
  assert float(stats.compression_factor) == pytest.approx(4 * N / (8 * k))
  # The wire: what the ring algorithms move for the step's collectives
  # (the compiled step's, less the non-finite flag's scalar all-reduce).
  flag = jaxcomp.wire.ring_bytes("all-reduce", 4, 8)
  assert float(stats.wire_bytes) == pytest.approx(traffic.ring_bytes - flag)
  assert float(stats.dense_wire_bytes) == pytest.approx(2 * 7 / 8 * 4 * N)
  assert float(stats.wire_compression_factor) == pytest.approx(wire_factor)


def test_psum_compressors_keep_their_factor_on_the_wire(mesh8):
  stats, traffic = _step_traffic(
      jaxcomp.compressed_mean("bf16", "data"), mesh8, {"w": jnp.zeros((N,))})
  assert float(stats.compression_factor) == pytest.approx(2.0)
  assert float(stats.wire_compression_factor) == pytest.approx(2.0)


def test_get_stats_counts_every_compressed_mean(mesh8):
  """A multi_transform with two compressed_means: get_stats totals both,
  and by_path returns each."""
  params = {"dense": jnp.zeros((1000,)), "sparse": jnp.zeros((2000,))}
  tx = optax.multi_transform(
      {"a": jaxcomp.compressed_mean("bf16", "data"),
       "b": jaxcomp.compressed_mean("topk", "data", ratio=0.1)},
      {"dense": "a", "sparse": "b"})
  stats, _ = _step_traffic(tx, mesh8, params)
  assert float(stats.bytes_sent) == 2 * 1000 + 8 * 200
  assert float(stats.dense_bytes) == 4 * 3000
  assert float(stats.compression_factor) == pytest.approx(12000 / 3600)
  f, state, _ = sharded_update(tx, params, mesh8)
  each = jaxcomp.get_stats(state, by_path=True)
  assert len(each) == 2
  assert sorted(float(s.bytes_sent) for s in each.values()) == [1600, 2000]
  # Operand bytes in the lowered step (XLA:CPU later widens the bf16
  # all-reduce to float32): both transforms' payloads and top-k's non-finite
  # flag (bf16, stateless and dense, needs none).
  g = stacked(jax.tree.map(lambda p: jnp.ones((8, *p.shape)), params), mesh8)
  lowered = jaxcomp.collective_traffic(f.lower(g, state))
  assert lowered.operand_bytes == 2 * 1000 + 8 * 200 + 4


def test_bf16_gradients_travel_in_bf16_with_float32_residuals(mesh8):
  """Native low precision ([integration] item 6): identity of bfloat16
  gradients is a bfloat16 all-reduce (2 n bytes, as a bf16 pmean), top-k's
  values travel in bfloat16 beside int32 indices, the residual stays
  float32, and dense_bytes counts the model's own dtype."""
  n = 10_000
  params = {"w": jnp.zeros((n,), jnp.bfloat16)}
  for name, kw, sent in (("identity", {}, 2 * n),
                         ("topk", {"ratio": 0.01}, (2 + 4) * 100)):
    f, state, _ = sharded_update(
        jaxcomp.compressed_mean(name, "data", **kw), params, mesh8)
    g = stacked({"w": jnp.ones((8, n), jnp.bfloat16)}, mesh8)
    lowered = jaxcomp.collective_traffic(f.lower(g, state))
    stats = jaxcomp.get_stats(state)
    assert float(stats.bytes_sent) == sent
    assert float(stats.dense_bytes) == 2 * n
    # + the non-finite flag, which identity (stateless, every coordinate
    # sent) does without: a NaN reaches its mean by itself.
    assert lowered.operand_bytes == sent + (0 if name == "identity" else 4)
    if name == "topk":
      (residual,) = jax.tree.leaves(state.feedback)
      assert residual.dtype == jnp.float32
    u, _ = f(g, state)
    assert u["w"].dtype == jnp.bfloat16


def _exchange_bytes(ops, group_size, kinds=("all-reduce", "reduce-scatter")):
  return sum(o.operand_bytes for o in ops
             if o.group_size == group_size and o.kind in kinds)


def test_dense_bytes_is_each_averaged_element_in_its_own_dtype():
  assert jaxcomp.transform.dense_bytes_of(
      [10, 6], [jnp.float32, jnp.bfloat16]) == 4 * 10 + 2 * 6
  assert jaxcomp.transform.dense_bytes_of([], []) == 0


def test_diloco_islands_report_each_step_and_each_sync_apart():
  """The trial's recipe (islands): an exact float32 mean inside each island
  every step, and DiLoCo's bf16 sync across islands every 4 steps. Each is
  its own exchange with its own cadence; the bytes are each one's, from
  the parameter count, and what the compiled step sends (the sync inside
  its branch), never their sum."""
  from tests.test_islands import _batches, _islands_tx, _setup
  from tests.test_lowcomm import SHAPES
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  mesh = jax.make_mesh((2, 4), ("hosts", "data"))
  n = sum(int(np.prod(s)) for s in SHAPES.values())  # 98 float32 parameters
  tx = _islands_tx(optax.sgd(0.1), sync_every=4, compressor="bf16")
  state, step = _setup(tx, mesh)
  st = state.opt_state
  each = jaxcomp.get_stats(st, by_exchange=True)
  assert list(each) == ["data", "hosts"]
  inner, sync = each["data"], each["hosts"]
  assert (inner.axis_name, inner.collective, inner.every) == (
      "data", "all-reduce", 1)
  assert (sync.axis_name, sync.collective, sync.every) == (
      "hosts", "all-reduce", 4)
  assert float(inner.bytes_sent) == float(inner.dense_bytes) == 4 * n
  assert float(sync.bytes_sent) == 2 * n  # bf16, once per 4 steps
  assert float(sync.dense_bytes) == 4 * n
  assert float(sync.compression_factor) == 2.0
  # Ring all-reduces over 4 devices (inside an island) and over 2 islands.
  assert float(inner.wire_bytes) == pytest.approx(2 * 3 / 4 * 4 * n)
  assert float(sync.wire_bytes) == pytest.approx(2 * 1 / 2 * 2 * n)
  # One number for both is refused, naming the two cadences.
  with pytest.raises(ValueError, match=r"2 exchanges \('data': all-reduce "
                     r"every step; 'hosts': all-reduce every 4 steps\)"):
    jaxcomp.get_stats(st)
  by_path = jaxcomp.get_stats(st, by_path=True)
  assert sorted((s.axis_name, s.every) for s in by_path.values()) == [
      ("data", 1), ("hosts", 4)]
  # The step: the mean over "data" (groups of 4) outside the sync branch,
  # the sync over "hosts" (groups of 2) inside it (its non-finite flag
  # spans all 8 devices); bytes as lowered, bf16 as sent (XLA:CPU widens
  # it when compiling).
  lowered = step.lower(state, _batches(mesh, 1)[0])
  compiled = jaxcomp.collective_traffic(lowered.compile()).ops
  assert {(o.group_size, o.in_branch) for o in compiled} == {
      (4, False), (2, True), (8, True)}
  ops = jaxcomp.collective_traffic(lowered).ops
  assert _exchange_bytes(ops, 4) == float(inner.bytes_sent)
  assert _exchange_bytes(ops, 2) == float(sync.bytes_sent)
  # lowcomm.traffic counts the syncs alone.
  for batch in _batches(mesh, 4):
    state, _ = step(state, batch)
  assert jaxcomp.lowcomm.traffic(state.opt_state).bytes_per_step == 2 * n / 4


def test_hsdp_reports_the_reduce_scatter_and_the_hosts_mean_apart():
  """HSDP: an exact reduce-scatter over "devices" and a bf16 mean of the
  shards over "hosts", both every step, over different links: two
  exchanges, each with its own bytes from the parameter count."""
  from tests.test_fsdp import SHAPES, _hsdp_run
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  mesh = jax.make_mesh((2, 4), ("hosts", "devices"))
  tx = optax.chain(
      jaxcomp.compressed_mean("identity", "devices", output="shard"),
      jaxcomp.compressed_mean("bf16", "hosts"), optax.sgd(0.1))
  _, _, st, step, args = _hsdp_run(mesh, tx, steps=1)
  # Each leaf padded to 4 shards of c = ceil(n / 4): 92 + 8 + 300 elements.
  shard = sum(-(-int(np.prod(s)) // 4) for s in SHAPES.values())
  assert shard == 100
  each = jaxcomp.get_stats(st, by_exchange=True)
  assert list(each) == ["devices", "hosts"]
  rs, across = each["devices"], each["hosts"]
  assert (rs.collective, rs.every) == ("reduce-scatter", 1)
  assert (across.collective, across.every) == ("all-reduce", 1)
  assert float(rs.bytes_sent) == float(rs.dense_bytes) == 4 * 4 * shard
  assert float(across.bytes_sent) == 2 * shard
  assert float(across.dense_bytes) == 4 * shard
  assert float(rs.wire_bytes) == pytest.approx(3 / 4 * 4 * 4 * shard)
  with pytest.raises(ValueError, match="by_exchange=True"):
    jaxcomp.get_stats(st)
  # The lowered step (bf16 as sent): the reduce-scatter in groups of 4
  # (beside the parameters' all-gathers), the hosts' mean in groups of 2.
  ops = jaxcomp.collective_traffic(step.lower(*args)).ops
  assert _exchange_bytes(ops, 4) == float(rs.bytes_sent)
  assert _exchange_bytes(ops, 2) == float(across.bytes_sent)


def test_multi_steps_exchanges_once_per_every_k_calls(mesh8):
  """Around multi_steps the exchange runs on every 3rd call of the step:
  its statistics say so, at init and after the steps, whichever branch
  the last call took."""
  from tests.helpers import run_steps
  tx = jaxcomp.multi_steps(optax.chain(
      jaxcomp.compressed_mean("bf16", "data"), optax.sgd(0.1)), 3)
  g = {"w": jnp.ones((8, 100))}
  for steps in (1, 3, 4):
    stats = jaxcomp.get_stats(run_steps(tx, g, mesh8, steps=steps).state)
    assert (stats.every, float(stats.bytes_sent)) == (3, 2 * 100)


def test_get_stats_reads_a_compressed_optimizer_and_never_half_a_state(mesh8):
  """A compressed optimizer's state: get_stats returns its phases (a
  OneBitTraffic), by path too; beside a compressed_mean, or beside another
  compressed optimizer, it raises and names by_path; a state with neither
  is None."""
  params = {"w": jnp.zeros(4096)}
  onebit = jaxcomp.init(jaxcomp.onebit_adam(1e-3, axis_name="data",
                                            freeze_step=3),
                        params, mesh8).opt_state
  mean = jaxcomp.init(jaxcomp.compressed_mean("topk", "data", ratio=0.1),
                      params, mesh8).opt_state
  t = jaxcomp.get_stats(onebit)
  assert isinstance(t, jaxcomp.transform.OneBitTraffic)
  assert (t.dense_steps, t.compressed_steps, t.silent_steps) == (0, 0, 0)
  assert (t.dense_bytes_per_exchange, t.compressed_bytes_per_exchange) == (
      16384.0, 584.0)
  both = (mean, onebit)
  for kwargs in ({}, {"by_exchange": True}):
    with pytest.raises(ValueError, match=r"by_path=True"):
      jaxcomp.get_stats(both, **kwargs)
  with pytest.raises(ValueError, match=r"2 compressed optimizers.*by_path"):
    jaxcomp.get_stats((onebit, onebit))
  each = jaxcomp.get_stats(both, by_path=True)
  assert list(each) == ["[0]", "[1]"]
  assert float(each["[0]"].bytes_sent) == float(jaxcomp.get_stats(mean).bytes_sent)
  assert each["[1]"] == t
  with pytest.raises(ValueError, match="outside jit"):
    jax.jit(jaxcomp.get_stats)(onebit)
  assert jaxcomp.get_stats(optax.adam(1e-3).init(params)) is None
