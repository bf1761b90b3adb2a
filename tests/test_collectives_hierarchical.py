"""Hierarchical collective on a ("hosts", "devices") = (2, 4) mesh: exactness,
equality with the flat exchange, error feedback, traffic per axis, bad axes."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

import jaxcomp
from jaxcomp._parts import concat as concat_parts
from jaxcomp.collectives import Hierarchical
from tests.helpers import run_shard_map, run_steps

AX = ("hosts", "devices")
HOSTS, PER_HOST = 2, 4
N = 37  # not a multiple of 4 or 8


@pytest.fixture(scope="module")
def mesh():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  return jax.make_mesh((HOSTS, PER_HOST), AX)


def int_grads(seed, n=N):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.integers(-20, 21, (8, n)), jnp.float32)}


@pytest.mark.parametrize("coll", [
    Hierarchical(fast_axis="devices", slow_axis="hosts"),
    Hierarchical(fast_axis="devices", slow_axis="hosts", fast="reduce_scatter",
                 inner="allgather"),
    "hierarchical"])
def test_identity_equals_pmean(mesh, coll):
  g = int_grads(0)
  u, ref, _, _ = run_shard_map(
      jaxcomp.compressed_mean("identity", AX, collective=coll), g, mesh, axis=AX)
  np.testing.assert_array_equal(np.asarray(u["w"]), np.asarray(ref["w"]))


@pytest.mark.parametrize("fast", ["psum", "reduce_scatter"])
@pytest.mark.parametrize("inner", ["allgather", "two_phase"])
def test_exact_compressor_equals_flat(mesh, fast, inner):
  g = int_grads(1)
  flat, _, _, _ = run_shard_map(jaxcomp.compressed_mean("topk", AX, ratio=1.0),
                                g, mesh, axis=AX)
  hier, _, _, _ = run_shard_map(jaxcomp.compressed_mean(
      "topk", AX, ratio=1.0,
      collective=Hierarchical(inner=inner, fast=fast)), g, mesh, axis=AX)
  np.testing.assert_array_equal(np.asarray(hier["w"]), np.asarray(flat["w"]))


@pytest.fixture(scope="module")
def topk_psum_run(mesh):
  g = {"w": jax.random.normal(jax.random.key(2), (8, N))}
  tx = jaxcomp.compressed_mean(
      "topk", AX, ratio=0.1,
      collective=Hierarchical(fast_axis="devices", slow_axis="hosts"))
  return g, run_steps(tx, g, mesh, axis=AX)


def test_residual_is_the_host_error(topk_psum_run):
  g, run = topk_psum_run
  u, state = run.updates, run.state
  x = np.asarray(g["w"]).reshape(HOSTS, PER_HOST, N)
  e = np.asarray(concat_parts(state.feedback[0])).reshape(HOSTS, PER_HOST, N)
  host_mean = x.mean(axis=1)
  for h in range(HOSTS):
    # Same residual on every device of a host: the host mean minus its
    # top-k (k = 4 of 37), which is what the host sent.
    for d in range(1, PER_HOST):  # (x - (x - host + sent) rounds per device)
      np.testing.assert_allclose(e[h, d], e[h, 0], rtol=0, atol=1e-6)
    sent = host_mean[h] - e[h, 0]
    assert np.count_nonzero(np.abs(sent) > 1e-6) == 4
    top = np.argsort(-np.abs(host_mean[h]))[:4]
    np.testing.assert_allclose(sent[top], host_mean[h][top], atol=1e-6)
  # Mass: 8 * mean == sum over devices of (g - e).
  np.testing.assert_allclose(8 * np.asarray(u["w"]), (x - e).sum(axis=(0, 1)),
                             rtol=1e-5, atol=1e-5)


def test_traffic_per_axis(topk_psum_run):
  """Operand bytes by replica-group size: the fast axis (groups of 4) carries
  the float32 buffer, the slow axis (groups of 2) only top-k payloads."""
  _, run = topk_psum_run
  state = run.state
  traffic = jaxcomp.collective_traffic(run.compiled())
  by_group = {}
  for op in traffic.ops:
    by_group[op.group_size] = by_group.get(op.group_size, 0) + op.operand_bytes
  comp = jaxcomp.compressors.get("topk", ratio=0.1)
  assert by_group[PER_HOST] == 4 * N
  assert by_group[HOSTS] == comp.payload_bytes(N)
  # The only all-device collective is the non-finite flag (4 bytes).
  assert by_group[8] == 4
  coll = Hierarchical(fast_axis="devices", slow_axis="hosts")
  sizes = {"hosts": HOSTS, "devices": PER_HOST}
  assert coll.payload_bytes(comp, ((N,),), sizes) == 4 * N + comp.payload_bytes(N)
  # The transform's statistics count the same operand bytes.
  assert int(jaxcomp.get_stats(state).bytes_sent) == 4 * N + comp.payload_bytes(N)


def test_reduce_scatter_mass_and_slow_bytes(mesh):
  g = {"w": jax.random.normal(jax.random.key(3), (8, N))}
  tx = jaxcomp.compressed_mean(
      "topk", AX, ratio=0.25,
      collective=Hierarchical(fast="reduce_scatter", inner="allgather"))
  run = run_steps(tx, g, mesh, axis=AX, ref=True)
  u, state, compiled = run.updates, run.state, run.compiled()
  e = np.asarray(concat_parts(state.feedback[0]))
  np.testing.assert_allclose(8 * np.asarray(u["w"]),
                             (np.asarray(g["w"]) - e).sum(0), rtol=1e-5,
                             atol=1e-5)
  slow = sum(op.operand_bytes for op in jaxcomp.collective_traffic(compiled).ops
             if op.group_size == HOSTS)
  comp = jaxcomp.compressors.get("topk", ratio=0.25)
  assert slow == comp.payload_bytes(-(-N // PER_HOST))  # a quarter's top-k


class TestBadAxes:

  def test_fast_axis_not_in_axis_name(self):
    with pytest.raises(ValueError, match="fast_axis 'gpus'"):
      jaxcomp.compressed_mean(
          "topk", AX, collective=Hierarchical(fast_axis="gpus",
                                              slow_axis="hosts"))

  def test_slow_axis_not_in_axis_name(self):
    with pytest.raises(ValueError, match="slow_axis 'nodes'"):
      jaxcomp.compressed_mean(
          "topk", AX, collective=Hierarchical(fast_axis="devices",
                                              slow_axis="nodes"))

  def test_axis_name_with_extra_axis(self):
    with pytest.raises(ValueError, match="neither"):
      jaxcomp.compressed_mean(
          "topk", ("pods", "hosts", "devices"),
          collective=Hierarchical(fast_axis="devices", slow_axis="hosts"))

  def test_single_axis(self):
    with pytest.raises(ValueError, match="slow and a fast axis"):
      jaxcomp.compressed_mean("topk", "data", collective="hierarchical")

  def test_construction(self):
    with pytest.raises(ValueError, match="different mesh axes"):
      Hierarchical(fast_axis="hosts", slow_axis="hosts")
    with pytest.raises(ValueError, match="both fast_axis and slow_axis"):
      Hierarchical(fast_axis="devices")
    with pytest.raises(ValueError, match="fast must be one of"):
      Hierarchical(fast="ring")
    with pytest.raises(ValueError, match="non-empty"):
      Hierarchical(fast_axis="", slow_axis="hosts")

  def test_inner_must_carry_compressor(self):
    with pytest.raises(ValueError, match="linear"):
      jaxcomp.compressed_mean("topk", AX, collective=Hierarchical(inner="psum"))

  def test_axis_not_in_mesh(self, mesh8):
    tx = jaxcomp.compressed_mean("topk", AX, collective="hierarchical")
    with pytest.raises(ValueError, match="not in the mesh"):
      jaxcomp.placement.init_sharded(tx, {"w": jnp.zeros(3)}, mesh8, AX)

  def test_unbound_axis_at_trace_time(self, mesh8):
    coll = Hierarchical(fast_axis="devices", slow_axis="data")
    comp = jaxcomp.compressors.get("topk")

    def f(x):
      return coll.exchange(comp, (x,), ((4,),), key=jax.random.key(0),
                           step=jnp.int32(0), axis_name=("data", "devices"))[0][0]

    with pytest.raises(NameError, match="fast_axis 'devices' is not bound"):
      jax.jit(jax.shard_map(f, mesh=mesh8, in_specs=P("data"),
                            out_specs=P())).lower(
          jax.device_put(jnp.zeros(8 * 4), NamedSharding(mesh8, P("data"))))
