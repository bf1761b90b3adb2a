"""Traffic read from the compiled HLO of real train steps."""

from flax import nnx
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
import optax
import pytest

import jaxcomp
from examples.fashion_mnist.train import CNN
from tests.exchange_helpers import exchange_traffic


def _train_step_traffic(mesh, compressor, lowered=False, **kwargs):
  # optax.adam's bias correction mixes int32 counts and floats, which strict
  # promotion rejects; jaxcomp's own code is traced strictly elsewhere.
  with jax.numpy_dtype_promotion("standard"):
    return _traffic(mesh, compressor, lowered, **kwargs)


def _traffic(mesh, compressor, lowered, **kwargs):
  graphdef, params = nnx.split(CNN(10, rngs=nnx.Rngs(0)), nnx.Param)
  params = nnx.as_pure(params)
  x = jnp.zeros((64, 28, 28, 1))
  y = jnp.zeros((64,), jnp.int32)

  def loss_fn(p, batch):
    x, y = batch
    logits = nnx.merge(graphdef, p)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  tx = optax.chain(jaxcomp.compressed_mean(compressor, "data", **kwargs),
                   optax.adam(1e-3))
  state = jaxcomp.init(tx, params, mesh)
  f = jaxcomp.make_train_step(loss_fn, tx, mesh=mesh, donate=False)
  batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
  low = f.lower(state, batch)
  n = sum(l.size for l in jax.tree.leaves(params))
  traffic = jaxcomp.collective_traffic(low if lowered else low.compile())
  return traffic, n, jaxcomp.get_stats(state.opt_state)


@pytest.fixture(scope="module")
def identity_traffic(mesh8):
  return _train_step_traffic(mesh8, "identity")


def test_identity_sends_the_whole_gradient_once(identity_traffic):
  traffic, n, _ = identity_traffic
  # One float32 all-reduce of the gradient, plus the loss pmean (4 bytes):
  # the plain step's collectives, no non-finite flag (identity keeps no
  # state, and a NaN reaches its mean by itself).
  assert traffic.by_kind() == {"all-reduce": 4 * n + 4}


def test_topk_leaves_no_gradient_sized_collective(mesh8, identity_traffic):
  dense, n, _ = identity_traffic
  traffic, _, stats = _train_step_traffic(mesh8, "topk", ratio=0.01)
  # The pcast trap is avoided: nothing close to the gradient's size travels.
  assert traffic.largest() < 0.02 * 4 * n
  assert traffic.operand_bytes <= 0.025 * dense.operand_bytes
  # The compressor's own formula matches the compiled program.
  assert traffic.operand_bytes == int(stats.bytes_sent) + 8


def test_topk_with_2_bit_values_sends_its_formula(mesh8, identity_traffic):
  """SparseLoCo-style top-k: indices plus 2-bit values and one step per
  bucket, counted from the compiled program, 53% of float32 top-k's."""
  _, n, _ = identity_traffic
  traffic, _, stats = _train_step_traffic(mesh8, "topk", ratio=0.01,
                                          value_bits=2)
  plain, _, plain_stats = _train_step_traffic(mesh8, "topk", ratio=0.01)
  assert traffic.operand_bytes == int(stats.bytes_sent) + 8
  assert (traffic.operand_bytes - 8) < 0.54 * (plain.operand_bytes - 8)


def test_qsgd_sends_at_most_a_quarter(mesh8, identity_traffic):
  dense, _, _ = identity_traffic
  traffic, _, stats = _train_step_traffic(mesh8, "qsgd", levels=4)
  assert traffic.operand_bytes <= dense.operand_bytes / 4
  assert traffic.operand_bytes == int(stats.bytes_sent) + 8


def test_random_block_goes_through_psum(mesh8):
  traffic, _, stats = _train_step_traffic(mesh8, "random_block", ratio=0.05)
  assert set(traffic.by_kind()) == {"all-reduce"}
  assert traffic.operand_bytes == int(stats.bytes_sent) + 8


def test_bf16_payload_in_lowered_program(mesh8, identity_traffic):
  dense, n, _ = identity_traffic
  traffic, _, stats = _train_step_traffic(mesh8, "bf16", lowered=True)
  assert traffic.operand_bytes == 2 * n + 4 == int(stats.bytes_sent) + 4


@pytest.mark.parametrize("p", [2, 4, 8])
def test_allgather_ring_bytes_grow_with_devices(p):
  comp = jaxcomp.compressors.get("topk", ratio=0.1)
  n = 1000
  traffic = exchange_traffic(jaxcomp.collectives.AllGatherMean(), comp, n, p)
  assert traffic.operand_bytes == comp.payload_bytes(n) == 8 * 100
  assert traffic.ring_bytes == (p - 1) * comp.payload_bytes(n)
  for op in traffic.ops:
    assert op.replica_groups == [list(range(p))]


def test_hlo_parser_on_hand_written_text():
  text = """
  %p0 = f32[16,4]{1,0} parameter(0)
  %ar = (f32[16,4]{1,0}, /*index=1*/bf16[10]{0}) all-reduce(%p0, /*index=1*/%p1), replica_groups=[2,4]<=[8], to_apply=%add
  %ag = s32[8,3]{1,0} all-gather(s32[1,3]{1,0} %x), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %p1 = bf16[10]{0} parameter(1)
  %cp = u32[5]{0} collective-permute(%y), source_target_pairs={{0,1},{1,0}}
  %y = u32[5]{0} parameter(2)
  """
  t = jaxcomp.collective_traffic(text)
  kinds = [op.kind for op in t.ops]
  assert kinds == ["all-reduce", "all-gather", "collective-permute"]
  ar, ag, cp = t.ops
  assert ar.operand_bytes == 16 * 4 * 4 + 10 * 2
  assert ar.replica_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert ar.ring_bytes == pytest.approx(2 * 3 / 4 * ar.operand_bytes)
  assert ag.operand_bytes == 12 and ag.result_bytes == 96
  assert ag.ring_bytes == 7 * 12
  assert cp.operand_bytes == 20 and cp.replica_groups == [[0, 1], [1, 0]]
  assert t.operand_bytes == ar.operand_bytes + 12 + 20
  assert ar.operand_sizes == (16 * 4 * 4, 10 * 2)
  assert t.messages == [("all-reduce", 256), ("all-reduce", 20), ("all-gather", 12),
                        ("collective-permute", 20)]


def test_messages_count_every_operand_of_a_combined_collective(mesh8):
  # Three independent psums: XLA's all-reduce combiner may merge them into
  # one tuple-shaped op, but each operand stays one message of its own size.
  sizes = (8, 300, 5000)
  f = jax.jit(jax.shard_map(lambda *xs: tuple(lax.psum(x, "data") for x in xs), mesh=mesh8,
                            in_specs=(P("data"),) * 3, out_specs=(P(),) * 3))
  args = [jax.device_put(jnp.ones((8 * n,), jnp.float32), NamedSharding(mesh8, P("data")))
          for n in sizes]
  traffic = jaxcomp.collective_traffic(f.lower(*args).compile())
  assert sorted(traffic.messages) == [("all-reduce", 4 * n) for n in sizes]
  assert sum(b for _, b in traffic.messages) == traffic.operand_bytes
  assert len(traffic.ops) <= len(traffic.messages)


def test_mesh_form_replica_groups_are_read():
  """XLA writes collectives over mesh axes as replica_groups=mesh[...]
  {axes} (GSPMD's data-parallel all-reduce on a (data, model) mesh)."""
  from jaxcomp.hlo.traffic import _parse_groups
  attrs = ("channel_id=2, replica_groups=mesh['axis_0'=4,'axis_1'=1,"
           "'axis_2'=2] {'axis_0'}, use_global_device_ids=true")
  assert _parse_groups(attrs, 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
  attrs = "replica_groups=mesh['a'=2,'b'=2,'c'=2] {'a','b'}, x=1"
  assert _parse_groups(attrs, 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
  attrs = "replica_groups=mesh['a'=2,'b'=4] {'b'}, x=1"
  assert _parse_groups(attrs, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_mesh_form_with_device_ids_is_read():
  """XLA (JAX 0.10.2's GSPMD on a (data, fsdp, tensor) mesh) writes a mesh of
  its own with the devices in another order: replica_groups=mesh[...],
  device_ids=([2,2,2]T(1,0,2)) {axes}; the groups are the listed ids'."""
  from jaxcomp.hlo.traffic import _parse_groups
  attrs = ("channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4], "
           "device_ids=([2,2,2]T(1,0,2)) {'axis_0'}, dimensions={0}")
  # ids in mesh order: 0,1,4,5 | 2,3,6,7; groups over axis_0 are columns.
  assert _parse_groups(attrs, 8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
  attrs = ("replica_groups=mesh['a'=2,'b'=2], device_ids=(3,2,1,0) {'b'}, "
           "dimensions={0}")
  assert _parse_groups(attrs, 4) == [[3, 2], [1, 0]]
  attrs = "replica_groups=mesh['a'=2,'b'=2], device_ids=([4]) {'a'}, x=1"
  assert _parse_groups(attrs, 4) == [[0, 2], [1, 3]]
