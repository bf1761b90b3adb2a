"""PowerSGD: rank-r recovery, warm-started Q in the state, start_iter,
min_compression_rate, scheduled rank, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp.compressors import PowerSGD
from jaxcomp.compressors.powersgd import matrix_shape, orthogonalize, tensor_matrix_shape
from tests.exchange_helpers import exchange_fn
from tests.helpers import sharded_update, stacked

ROWS = COLS = 32
N = ROWS * COLS
SHAPE = (ROWS, COLS)  # one tensor, viewed as this matrix


def _rank_r_grads(r, seed=0):
  """Per-device (8, N) gradients M_i = A B_i^T: the mean has rank r."""
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(ROWS, r))
  b = rng.normal(size=(8, COLS, r))
  return jnp.asarray(np.einsum("rk,dck->drc", a, b).reshape(8, N), jnp.float32)


def test_matrix_view_and_orthogonalize():
  assert matrix_shape(1024) == (32, 32)
  assert matrix_shape(48 * 64) == (48, 64)
  assert matrix_shape(13) == (1, 13)
  m = jax.random.normal(jax.random.key(0), (20, 4))
  q = orthogonalize(m)
  np.testing.assert_allclose(q.T @ q, np.eye(4), atol=1e-5)
  # Gram-Schmidt keeps the span of the leading columns (QR with R > 0).
  qr, rr = np.linalg.qr(np.asarray(m))
  np.testing.assert_allclose(np.asarray(q), qr * np.sign(np.diag(rr)),
                             atol=1e-5)


@pytest.mark.parametrize("cond", [1e3, 1e5])
def test_orthogonalize_keeps_orthogonality_of_ill_conditioned_columns(cond):
  # A (256, 4) float32 matrix with singular values 1 .. 1/cond: one
  # Gram-Schmidt pass leaves |Q^T Q - I| near cond * eps (float32 eps is
  # 1.2e-7); the reorthogonalized one stays at float32 rounding.
  rng = np.random.default_rng(11)
  u, _ = np.linalg.qr(rng.normal(size=(256, 4)))
  v, _ = np.linalg.qr(rng.normal(size=(4, 4)))
  m = (u * np.geomspace(1.0, 1.0 / cond, 4)) @ v.T
  q = np.asarray(orthogonalize(jnp.asarray(m, jnp.float32)), np.float64)
  assert np.abs(q.T @ q - np.eye(4)).max() < 2e-6
  # Same span as m: projecting m onto q leaves it unchanged.
  np.testing.assert_allclose(q @ (q.T @ m), m, atol=1e-6)
  # A zero column stays zero, the others orthonormal (epsilon == 0).
  z = np.asarray(orthogonalize(jnp.asarray(m, jnp.float32).at[:, 1].set(0.0)))
  assert not z[:, 1].any()
  np.testing.assert_allclose(z[:, [0, 2, 3]].T @ z[:, [0, 2, 3]], np.eye(3), atol=2e-6)


@pytest.mark.parametrize("r", [1, 3])
def test_rank_r_gradient_is_recovered(mesh8, r):
  xs = _rank_r_grads(r)
  means, locs, _ = exchange_fn(mesh8, PowerSGD(rank=r), N, shape=SHAPE)(
      xs, jax.random.key(0))
  ref = np.asarray(xs).mean(axis=0)
  np.testing.assert_allclose(np.asarray(means[0]), ref, atol=1e-4 * np.abs(
      ref).max())
  # local is the mean's approximation on every device (PyTorch's hook).
  np.testing.assert_array_equal(np.asarray(locs)[3, 0], np.asarray(means[0]))


def test_full_rank_is_exact(mesh8):
  xs = jnp.asarray(np.random.default_rng(2).normal(size=(8, N)), jnp.float32)
  comp = PowerSGD(rank=ROWS, min_compression_rate=0.1)
  means, _, _ = exchange_fn(mesh8, comp, N, shape=SHAPE)(xs, jax.random.key(0))
  np.testing.assert_allclose(np.asarray(means[0]), np.asarray(xs).mean(axis=0),
                             atol=1e-4)  # float32, cond(M) ~ 100


def test_warm_started_q_persists_across_steps(mesh8):
  comp = PowerSGD(rank=2)
  rng = np.random.default_rng(3)
  xs = jnp.asarray(rng.normal(size=(2, 8, N)), jnp.float32)
  key = jax.random.key(0)
  means, _, state = exchange_fn(mesh8, comp, N, steps=2, shape=SHAPE)(xs, key)
  (q,) = comp.init_state((SHAPE,), key, "data").q  # the shared initial Q
  m = np.asarray(xs, np.float64).reshape(2, 8, ROWS, COLS)
  for t in range(2):  # the power iteration by hand, Q carried over
    q = np.asarray(orthogonalize(jnp.asarray(q, jnp.float32)), np.float64)
    p = np.einsum("drc,ck->rk", m[t], q)
    p = np.asarray(orthogonalize(jnp.asarray(p, jnp.float32)), np.float64)
    q = np.einsum("drc,rk->ck", m[t], p) / 8
    np.testing.assert_allclose(np.asarray(means[t]), (p @ q.T).reshape(-1),
                               atol=1e-4)
  np.testing.assert_allclose(np.asarray(state.q[0])[0], q, atol=1e-4)


def test_start_iter_and_min_compression_rate(mesh8):
  rng = np.random.default_rng(4)
  xs = jnp.asarray(rng.normal(size=(3, 8, N)), jnp.float32)
  comp = PowerSGD(rank=1, start_iter=2)
  means, locs, _ = exchange_fn(mesh8, comp, N, steps=3, shape=SHAPE)(
      xs, jax.random.key(0))
  ref = np.asarray(xs).mean(axis=1)
  for t in range(2):  # exact all-reduce, and local = x (no residual)
    np.testing.assert_allclose(np.asarray(means[t]), ref[t], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_array_equal(np.asarray(locs[:, t]), np.asarray(xs[t]))
  assert np.linalg.norm(np.asarray(means[2]) - ref[2]) > 0.5 * np.linalg.norm(
      ref[2])  # compressed from step 2 on
  # 32 x 32 at rank 8: 1024 / (64 * 8) = 2 < 3, so it stays exact.
  exact = PowerSGD(rank=8, min_compression_rate=3.0)
  assert exact.matrices((SHAPE,)) == [(N, ROWS, COLS, 0)]
  assert exact.payload_bytes(N) == 4 * N
  assert PowerSGD(rank=8).payload_bytes(N) == 4 * 64 * 8


def test_scheduled_rank(mesh8):
  def make(rank):
    return jaxcomp.compressed_mean("powersgd", "data", nonfinite="zero",
                                   rank=rank, max_rank=4)

  tx = optax.inject_hyperparams(make)(rank=lambda step: 1 + 2 * step)
  f, state, _ = sharded_update(tx, {"w": jnp.zeros((ROWS, COLS))}, mesh8)
  g = stacked({"w": jnp.asarray(np.random.default_rng(5).normal(
      size=(8, ROWS, COLS)), jnp.float32)}, mesh8)
  ranks = []
  for _ in range(2):
    u, state = f(g, state)
    ranks.append(int(np.linalg.matrix_rank(np.asarray(u["w"]), tol=1e-4)))
  assert ranks == [1, 3]


def test_bad_input():
  with pytest.raises(ValueError, match="rank"):
    PowerSGD(rank=0)
  with pytest.raises(TypeError, match="rank"):
    PowerSGD(rank=1.5)
  with pytest.raises(ValueError, match="max_rank"):
    PowerSGD(rank=4, max_rank=2)
  with pytest.raises(ValueError, match="start_iter"):
    PowerSGD(start_iter=-1)
  with pytest.raises(ValueError, match="min_compression_rate"):
    PowerSGD(min_compression_rate=0.0)
  with pytest.raises(ValueError, match="view"):
    PowerSGD(view="square")
  # A rank above min(rows, cols) is capped (documented pass-through), in
  # the tensor view and the flat one (64 elements as an 8 x 8 matrix).
  assert PowerSGD(rank=100, min_compression_rate=0.1).matrices(((8, 8),)) == [
      (64, 8, 8, 8)]
  assert PowerSGD(rank=100, min_compression_rate=0.1, view="flat").matrices(
      ((64,),)) == [(64, 8, 8, 8)]


def _per_tensor_run(view, r=2, steps=1):
  """compressed_mean over one bucket holding a (64, 16) kernel whose mean
  gradient has rank r and a (16,) bias."""
  rng = np.random.default_rng(7)
  a = rng.normal(size=(64, r))
  w = np.einsum("rk,dck->drc", a, rng.normal(size=(8, 16, r)))
  g = {"b": rng.normal(size=(8, 16)), "w": w}
  g = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g)
  tx = jaxcomp.compressed_mean("powersgd", "data", rank=r, view=view, bucketing="whole",
                               nonfinite="zero")
  params = jax.tree.map(lambda x: jnp.zeros(x.shape[1:]), g)
  return g, params, tx


def test_per_tensor_view_recovers_each_kernel_and_sends_two_messages(mesh8):
  g, params, tx = _per_tensor_run("tensor")
  f, state, specs = sharded_update(tx, params, mesh8)
  u, state = f(stacked(g, mesh8), state)
  mean = jax.tree.map(lambda x: np.asarray(x).mean(0), g)
  # The kernel as its own (64, 16) matrix: a rank-2 mean is recovered.
  np.testing.assert_allclose(np.asarray(u["w"]), mean["w"], atol=1e-4 * np.abs(mean["w"]).max())
  # The bias goes through the exact all-reduce, in the same psum as the P's.
  np.testing.assert_allclose(np.asarray(u["b"]), mean["b"], rtol=1e-5, atol=1e-6)
  traffic = jaxcomp.collective_traffic(f.lower(stacked(g, mesh8), state).compile())
  assert sorted(b for _, b in traffic.messages) == sorted([4 * (16 + 64 * 2), 4 * 16 * 2])
  stats = jaxcomp.get_stats(state)
  assert float(stats.bytes_sent) == 4 * (16 + 64 * 2 + 16 * 2)
  q = jax.tree.leaves(state.exchange_state)
  assert any(np.shape(x)[-2:] == (16, 2) for x in q)  # Q of the (64, 16) kernel


def test_flat_view_mixes_rows_and_loses_the_low_rank_structure(mesh8):
  g, params, tx = _per_tensor_run("flat")
  f, state, _ = sharded_update(tx, params, mesh8)
  u, _ = f(stacked(g, mesh8), state)
  mean = np.asarray(g["w"]).mean(0)
  # 64 x 16 + 16 = 1040 elements viewed as 26 x 40: rank 2 no longer fits.
  err = np.linalg.norm(np.asarray(u["w"]) - mean)
  assert err > 0.05 * np.linalg.norm(mean)


def test_tensor_matrix_shape_splits_where_most_square():
  assert tensor_matrix_shape((64, 16)) == (64, 16)  # Dense (in, out)
  assert tensor_matrix_shape((3, 3, 32, 64)) == (288, 64)  # conv: im2col
  assert tensor_matrix_shape((3, 3, 1, 32)) == (9, 32)  # tie: the later split
  assert tensor_matrix_shape((128, 4, 32)) == (128, 128)  # attention q/k/v
  assert tensor_matrix_shape((4, 32, 128)) == (128, 128)  # attention output
  assert tensor_matrix_shape((7,)) == (1, 7)
  assert tensor_matrix_shape(()) == (1, 1)


def test_attention_kernel_is_viewed_as_its_projection(mesh8):
  # A (d, heads, head_dim) kernel whose mean gradient has rank 2 as the
  # (d, heads * head_dim) projection: recovered exactly at rank 2, where
  # the (d * heads, head_dim) view would need rank head_dim.
  rng = np.random.default_rng(3)
  d, h, dh, r = 32, 4, 8, 2
  a = rng.normal(size=(d, r))
  g = np.einsum("ir,pjr->pij", a, rng.normal(size=(8, h * dh, r))).reshape(8, d, h, dh)
  g = {"w": jnp.asarray(g, jnp.float32)}
  tx = jaxcomp.compressed_mean("powersgd", "data", rank=r, bucketing="whole",
                               nonfinite="zero")
  f, state, _ = sharded_update(tx, {"w": jnp.zeros((d, h, dh))}, mesh8)
  u, state = f(stacked(g, mesh8), state)
  mean = np.asarray(g["w"]).mean(0)
  np.testing.assert_allclose(np.asarray(u["w"]), mean, atol=1e-4 * np.abs(mean).max())
  assert float(jaxcomp.get_stats(state).bytes_sent) == 4 * (d + h * dh) * r
