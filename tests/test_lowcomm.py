"""DiLoCo with compressed pseudo-gradients (jaxcomp.diloco)."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomp
from jaxcomp import lowcomm
from tests import legacy_demo
from tests.helpers import run_steps, sharded_update, stacked

SHAPES = {"w": (13, 7), "b": (7,)}
ISLANDS = jaxcomp.Islands()  # DiLoCo's layout: one copy per device


def _params():
  k1, _ = jax.random.split(jax.random.key(0))
  return {"w": jax.random.normal(k1, SHAPES["w"]) * 0.3, "b": jnp.zeros(SHAPES["b"])}


def _loss(p, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ p["w"] + p["b"][None]) - y) ** 2)


def _batches(mesh, n):
  out = []
  for i in range(n):
    k1, k2 = jax.random.split(jax.random.key(100 + i))
    xy = (jax.random.normal(k1, (64, 13)), jax.random.normal(k2, (64, 7)))
    out.append(jax.device_put(xy, NamedSharding(mesh, P("data"))))
  return out


def _run(tx, mesh, batches, donate=True):
  state = jaxcomp.init(tx, _params(), mesh, layout=ISLANDS)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh, layout=ISLANDS, donate=donate)
  history = []
  for b in batches:
    state, loss = step(state, b)
    history.append((np.asarray(state.params["w"]), float(loss)))
  return state.params, state.opt_state, step, history


def test_one_step_interval_with_unit_outer_sgd_is_data_parallel_sgd(mesh8):
  batches = _batches(mesh8, 5)
  tx = jaxcomp.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=1)
  local, st, _, _ = _run(tx, mesh8, batches)
  ref_tx = optax.chain(jaxcomp.compressed_mean("identity", "data"), optax.sgd(0.1))
  ref_state = jaxcomp.init(ref_tx, _params(), mesh8)
  ref_step = jaxcomp.make_train_step(_loss, ref_tx, mesh=mesh8)
  for b in batches:
    ref_state, _ = ref_step(ref_state, b)
  ref = ref_state.params
  for k in SHAPES:
    got = np.asarray(local[k])
    for d in range(8):  # every device holds the same, synchronized parameters
      np.testing.assert_allclose(got[d], np.asarray(ref[k]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lowcomm.synced_params(st)[k]), np.asarray(ref[k]),
                               rtol=1e-5, atol=1e-6)


def test_devices_drift_between_syncs_and_meet_at_each(mesh8):
  tx = jaxcomp.diloco(optax.sgd(0.1), sync_every=3)
  _, st, step, history = _run(tx, mesh8, _batches(mesh8, 6))
  for i, (w, _) in enumerate(history):
    same = all(np.array_equal(w[0], w[d]) for d in range(8))
    assert same == ((i + 1) % 3 == 0), i
  # The collectives run inside the sync branch only: no exchange otherwise.
  fresh = jaxcomp.init(tx, _params(), mesh8, layout=ISLANDS)
  traffic = jaxcomp.collective_traffic(step.lower(fresh, _batches(mesh8, 1)[0]).compile())
  n = sum(int(np.prod(s)) for s in SHAPES.values())
  branch = [o for o in traffic.ops if o.in_branch]
  assert sum(o.operand_bytes for o in branch) == 4 * n + 4  # pseudo-gradient + non-finite flag
  assert sum(o.operand_bytes for o in traffic.ops if not o.in_branch) == 4  # the loss
  # per_device_loss: the steps between syncs run no collective at all.
  quiet = jaxcomp.make_train_step(_loss, tx, mesh=mesh8, layout=ISLANDS,
                                  per_device_loss=True)
  traffic = jaxcomp.collective_traffic(quiet.lower(fresh, _batches(mesh8, 1)[0]).compile())
  assert not [o for o in traffic.ops if not o.in_branch]
  _, losses = quiet(fresh, _batches(mesh8, 1)[0])
  assert losses.shape == (8,)


@pytest.mark.parametrize("compressor,kw,bound", [
    ("identity", {}, 1e-6),
    ("int8_block", {}, 1 / 127),   # nearest rounding: half a step of max|x| / 127, per block
    ("topk", {"ratio": 0.25}, None),
    ("topk", {"ratio": 0.25, "value_bits": 2}, None),  # SparseLoCo's payload
])
def test_pseudo_gradient_exchange_is_exact_or_bounded(mesh8, compressor, kw, bound):
  # With outer SGD(1.0), the new anchor is the old one minus the exchanged
  # mean pseudo-gradient: compare with the exact mean of the local params.
  batches = _batches(mesh8, 2)
  tx = jaxcomp.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=2, compressor=compressor,
                      error_feedback=False if compressor != "topk" else None, **kw)
  state = jaxcomp.init(tx, _params(), mesh8, layout=ISLANDS)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh8, layout=ISLANDS, donate=False)
  state, _ = step(state, batches[0])
  before = jax.tree.map(np.asarray, state.params)
  anchor0 = jax.tree.map(np.asarray, lowcomm.synced_params(state.opt_state))
  # The second step's local update, then the sync: recompute the locals
  # the sync saw from a copy that does not sync.
  free = jaxcomp.diloco(optax.sgd(0.1), optax.sgd(1.0), sync_every=1000)
  f_state = jaxcomp.init(free, _params(), mesh8, layout=ISLANDS)
  f_step = jaxcomp.make_train_step(_loss, free, mesh=mesh8, layout=ISLANDS)
  for b in batches:
    f_state, _ = f_step(f_state, b)
  seen = jax.tree.map(np.asarray, f_state.params)
  state, _ = step(state, batches[1])
  st = state.opt_state
  new = jax.tree.map(np.asarray, lowcomm.synced_params(st))
  del before
  for k in SHAPES:
    pseudo = anchor0[k][None] - seen[k]
    exact = anchor0[k] - pseudo.mean(0)
    err = np.abs(new[k] - exact).max()
    if bound is None:  # top-k with error feedback: what was not sent stays local
      resid = st.exchange_state[0].feedback
      assert err <= np.abs(pseudo).max() + 1e-6 and len(resid) > 0
    else:
      assert err <= bound * np.abs(pseudo).max() + 1e-7, (k, err)


@pytest.mark.parametrize("momentum", [None, 0.6])
def test_muloco_is_muon_per_worker_then_the_outer_step(mesh8, momentum):
  """MuLoCo (DiLoCo with Optax's Muon inside, outer momentum a parameter)
  over two intervals equals, computed apart: each worker running
  optax.contrib.muon on its own gradients from the anchor (its Muon state
  kept across syncs), and the outer step on the mean pseudo-gradient in
  NumPy (Nesterov: ``m = mu m + g``, ``anchor -= lr (g + mu m)``).
  (optax's Muon mixes Python floats with int32 counts, which strict
  promotion refuses.)"""
  with jax.numpy_dtype_promotion("standard"):
    _check_muloco(mesh8, momentum)


def _check_muloco(mesh8, momentum):
  h, lr = 3, 0.7
  inner = optax.contrib.muon(0.02)  # Muon on w (13 x 7), Adam on b
  outer = optax.sgd(lr, momentum=momentum, nesterov=momentum is not None)
  tx = jaxcomp.diloco(inner, outer, sync_every=h)
  batches = _batches(mesh8, 2 * h)
  local, st, _, _ = _run(tx, mesh8, batches)

  anchor = jax.tree.map(np.asarray, _params())
  mom = jax.tree.map(np.zeros_like, anchor)
  inner_states = [inner.init(_params()) for _ in range(8)]
  grad = jax.jit(jax.grad(_loss))
  update = jax.jit(inner.update)
  for start in range(0, 2 * h, h):
    pseudo = []
    for d in range(8):
      p = jax.tree.map(jnp.asarray, anchor)
      for b in batches[start:start + h]:
        shard = jax.tree.map(lambda a, d=d: np.asarray(a)[8 * d:8 * d + 8], b)
        u, inner_states[d] = update(grad(p, shard), inner_states[d], p)
        p = optax.apply_updates(p, u)
      pseudo.append(jax.tree.map(lambda a, q: a - np.asarray(q), anchor, p))
    g = jax.tree.map(lambda *xs: np.mean(xs, axis=0), *pseudo)
    if momentum is None:
      anchor = jax.tree.map(lambda a, x: a - lr * x, anchor, g)
    else:
      mom = jax.tree.map(lambda m, x: momentum * m + x, mom, g)
      anchor = jax.tree.map(lambda a, x, m: a - lr * (x + momentum * m),
                            anchor, g, mom)
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(lowcomm.synced_params(st)[k]),
                               anchor[k], rtol=2e-5, atol=2e-6)
    for d in range(8):
      np.testing.assert_array_equal(np.asarray(local[k])[d],
                                    np.asarray(lowcomm.synced_params(st)[k]))
  # Muon moved w unlike Adam would: the reference above is not vacuous.
  adam, _, _, _ = _run(jaxcomp.diloco(optax.adam(0.02), outer, sync_every=h),
                       mesh8, batches)
  assert not np.allclose(np.asarray(adam["w"]), np.asarray(local["w"]),
                         atol=1e-4)


@pytest.mark.parametrize("overlap", [0, 1])
def test_resume_mid_interval_is_bit_exact(mesh8, tmp_path, overlap):
  # overlap_steps=1: the checkpoint falls between an exchange (step 3) and
  # its landing (step 4), with the averaged pseudo-gradient pending.
  batches = _batches(mesh8, 5 + overlap)
  tx = jaxcomp.diloco(optax.sgd(0.1, momentum=0.9), sync_every=3, compressor="topk",
                      ratio=0.2, overlap_steps=overlap)
  state = jaxcomp.init(tx, _params(), mesh8, layout=ISLANDS)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh8, layout=ISLANDS, donate=False)
  cut = 3 if overlap else 2  # mid-interval, or with an update pending
  for b in batches[:cut]:
    state, _ = step(state, b)
  if overlap:
    assert np.abs(np.asarray(state.opt_state.pending[0][0])).max() > 0
  ckpt = jaxcomp.checkpoint.Checkpointer(tmp_path)
  ckpt.save(cut, {"params": state.params, "opt_state": state.opt_state})
  a = state
  for b in batches[cut:]:
    a, _ = step(a, b)
  fresh = jaxcomp.init(tx, _params(), mesh8, layout=ISLANDS)
  _, restored = ckpt.restore({"params": fresh.params, "opt_state": fresh.opt_state})
  r = dataclasses.replace(fresh, params=restored["params"],
                          opt_state=restored["opt_state"])
  for b in batches[cut:]:
    r, _ = step(r, b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(r)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _delayed_reference(targets, w0, *, steps, h, tau, merge, lr, outer_lr, offsets):
  """Streaming DiLoCo with delayed outer updates, in numpy: one leaf per
  fragment, loss_d(w) = 0.5 |w - t_d|^2, inner and outer plain SGD."""
  p, frags = targets.shape[0], len(offsets)
  local = np.repeat(w0[None], p, 0).astype(np.float64)
  anchor = w0.astype(np.float64).copy()
  pending = np.zeros_like(anchor)
  cols = np.array_split(np.arange(w0.size), frags)  # one leaf = one fragment
  history = []
  for step in range(steps):
    incoming = local.copy()
    local = local - lr * (local - targets)
    for j, c in enumerate(cols):
      landed = (step + 1 + offsets[j] - tau) % h == 0 and step >= tau
      if landed:
        anchor[c] = anchor[c] - outer_lr * pending[c]
        local[:, c] = merge * local[:, c] + (1 - merge) * anchor[c]
      if (step + 1 + offsets[j]) % h == 0:
        pending[c] = (anchor[c] - incoming[:, c]).mean(0)
    history.append(local.copy())
  return history, anchor


@pytest.mark.parametrize("fragments,tau,merge", [(1, 1, 0.5), (2, 2, 0.0), (2, 1, 0.25)])
def test_delayed_outer_updates_follow_the_reference(mesh8, fragments, tau, merge):
  # Streaming DiLoCo's overlap: each fragment's exchange (of the step's
  # incoming parameters) lands tau steps later, merged with the local
  # parameters. Checked against a numpy reference on a quadratic whose
  # gradient is w - t_d on device d.
  h, steps, n = 4, 11, 6
  targets = np.asarray(jax.random.normal(jax.random.key(5), (8, 2 * n)), np.float32)
  w0 = np.linspace(-1, 1, 2 * n).astype(np.float32)
  params = {"a": jnp.asarray(w0[:n]), "b": jnp.asarray(w0[n:])}
  if fragments == 1:
    params = {"a": jnp.asarray(w0)}

  def loss(p, t):
    w = jnp.concatenate([p[k] for k in sorted(p)])
    return 0.5 * jnp.sum((w - t[0]) ** 2)

  tx = jaxcomp.diloco(optax.sgd(0.1), optax.sgd(0.7), sync_every=h, fragments=fragments,
                      overlap_steps=tau, merge=merge)
  state = jaxcomp.init(tx, params, mesh8, layout=ISLANDS)
  step = jaxcomp.make_train_step(loss, tx, mesh=mesh8, layout=ISLANDS)
  t = jax.device_put(targets, NamedSharding(mesh8, P("data")))
  offsets = [j * h // fragments for j in range(fragments)]
  want, want_anchor = _delayed_reference(targets, w0, steps=steps, h=h, tau=tau, merge=merge,
                                         lr=0.1, outer_lr=0.7, offsets=offsets)
  for i in range(steps):
    state, _ = step(state, t)
    local = state.params
    got = np.concatenate([np.asarray(local[k]) for k in sorted(local)], axis=1)
    np.testing.assert_allclose(got, want[i], rtol=1e-5, atol=1e-6, err_msg=f"step {i}")
  anchor = lowcomm.synced_params(state.opt_state)
  np.testing.assert_allclose(np.concatenate([np.asarray(anchor[k]) for k in sorted(anchor)]),
                             want_anchor, rtol=1e-5, atol=1e-6)
  # The collectives run in the exchange branches only; landing sends nothing.
  fresh = jaxcomp.init(tx, params, mesh8, layout=ISLANDS)
  traffic = jaxcomp.collective_traffic(step.lower(fresh, t).compile())
  branch = sum(o.operand_bytes for o in traffic.ops if o.in_branch)
  assert branch == 4 * 2 * n + 4 * fragments  # each fragment once, with its flag


def test_diloco_refuses_bad_input():
  with pytest.raises(ValueError, match="overlap_steps must be an integer in \\[0, sync_every=4\\)"):
    jaxcomp.diloco(optax.sgd(0.1), sync_every=4, overlap_steps=4)
  with pytest.raises(ValueError, match="merge must be a number in \\[0, 1\\]"):
    jaxcomp.diloco(optax.sgd(0.1), sync_every=4, overlap_steps=1, merge=1.5)
  with pytest.raises(ValueError, match="sync_every must be an integer >= 1"):
    jaxcomp.diloco(optax.sgd(0.1), sync_every=0)
  with pytest.raises(ValueError, match="ratio"):
    jaxcomp.diloco(optax.sgd(0.1), sync_every=2, compressor="topk", ratio=float("nan"))


# -- DeMo ---------------------------------------------------------------------


def _dct_np(n):
  """Orthonormal DCT-II matrix, x @ m = DCT of x's rows (independent of jax)."""
  i, k = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
  m = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * i + 1) * k / (2 * n))
  m[:, 0] /= np.sqrt(2.0)
  return m


def _demo_reference(g, lr, topk, chunk, decay=0.999, delta=None):
  """bloc97/DeMo's step for one 2-D tensor on p devices, in NumPy."""
  p, rows, cols = g.shape
  h = max(d for d in range(1, min(rows, chunk) + 1) if rows % d == 0)
  w = max(d for d in range(1, min(cols, chunk) + 1) if cols % d == 0)
  mh, mw = _dct_np(h), _dct_np(w)
  delta = np.zeros_like(g, dtype=np.float64) if delta is None else delta
  delta = decay * delta + lr * g
  sums = np.zeros((rows // h, cols // w, h * w))
  counts = np.zeros_like(sums)
  new_delta = delta.copy()
  for d in range(p):
    for a in range(rows // h):
      for b in range(cols // w):
        x = delta[d, a * h:(a + 1) * h, b * w:(b + 1) * w]
        coef = (mh.T @ x @ mw).reshape(-1)
        keep = np.argsort(-np.abs(coef), kind="stable")[:topk]
        sent = np.zeros_like(coef)
        sent[keep] = coef[keep]
        new_delta[d, a * h:(a + 1) * h, b * w:(b + 1) * w] -= mh @ sent.reshape(h, w) @ mw.T
        sums[a, b, keep] += coef[keep]
        counts[a, b, keep] += 1
  mean = sums / np.maximum(counts, 1)
  out = np.zeros((rows, cols))
  for a in range(rows // h):
    for b in range(cols // w):
      out[a * h:(a + 1) * h, b * w:(b + 1) * w] = mh @ mean[a, b].reshape(h, w) @ mw.T
  return -lr * np.sign(out), new_delta


def test_demo_matches_the_reference_step(mesh8):
  g = np.asarray(jax.random.normal(jax.random.key(11), (8, 12, 10)), np.float32)
  tx = jaxcomp.demo(0.1, compression_topk=3, compression_chunk=4)  # chunks 4 x 5
  run = run_steps(tx, {"w": jnp.asarray(g)}, mesh8)
  u, state = run.updates, run.state
  want_u, want_delta = _demo_reference(g.astype(np.float64), 0.1, 3, 4)
  np.testing.assert_array_equal(np.asarray(u["w"]), want_u.astype(np.float32))
  np.testing.assert_allclose(
      np.asarray(lowcomm.demo_momentum(state, {"w": g[0]})["w"]), want_delta,
      rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kwargs", [
    dict(learning_rate=0.1, compression_topk=3, compression_chunk=4),
    dict(learning_rate=optax.linear_schedule(0.2, 0.05, 3), compression_topk=5,
         compression_chunk=8, weight_decay=0.1, compression_decay=0.9),
    dict(learning_rate=0.01)])
def test_demo_is_the_earlier_implementation_bit_for_bit(mesh8, kwargs):
  """jaxcomp.demo, now compressed_mean's four parts (DCT top-k compressor,
  sender-mean all-gather, decayed residual feedback), equals the step it
  was before (tests/legacy_demo.py) bit for bit: updates and momentum, over
  three steps, on vectors, matrices, a 3-D tensor and sides with no divisor
  near the chunk."""
  shapes = {"a": (12, 10), "b": (7,), "c": (4, 3, 5), "d": (130, 66)}
  params = {k: jnp.asarray(np.cos(np.arange(np.prod(s))).reshape(s), jnp.float32)
            for k, s in shapes.items()}
  runs = []
  for tx in (jaxcomp.demo(**kwargs), legacy_demo.demo(**kwargs)):
    f, state, _ = sharded_update(tx, params, mesh8, params_spec=P())
    p = jax.device_put(params, NamedSharding(mesh8, P()))
    out = []
    for t in range(3):
      g = {k: jax.random.normal(jax.random.key(100 * t + i), (8,) + s)
           for i, (k, s) in enumerate(sorted(shapes.items()))}
      u, state = f(stacked(g, mesh8), state, p)
      p = optax.apply_updates(p, u)
      delta = (state.delta if isinstance(state, legacy_demo.DeMoState)
               else lowcomm.demo_momentum(state, params))
      out.append(jax.tree.map(np.asarray, (u, delta)))
    runs.append(out)
  for new, old in zip(*runs):
    jax.tree.map(np.testing.assert_array_equal, new, old)


def test_demo_keeping_every_coefficient_sends_the_whole_momentum(mesh8):
  g = jax.random.normal(jax.random.key(12), (8, 16))
  tx = jaxcomp.demo(0.5, compression_topk=16, compression_chunk=16)
  run = run_steps(tx, {"w": g}, mesh8)
  u, state = run.updates, run.state
  np.testing.assert_allclose(
      np.asarray(lowcomm.demo_momentum(state, {"w": g[0]})["w"]), 0.0,
      atol=1e-6)
  np.testing.assert_array_equal(np.asarray(u["w"]),
                                -0.5 * np.sign(np.asarray(g).mean(0)).astype(np.float32))


def test_demo_traffic_from_hlo(mesh8):
  g = jax.random.normal(jax.random.key(13), (8, 256, 192))
  tx = jaxcomp.demo(0.1)
  traffic = jaxcomp.collective_traffic(run_steps(tx, {"w": g}, mesh8).compiled())
  sent = sum(o.operand_bytes for o in traffic.ops if o.kind == "all-gather")
  assert sent == lowcomm.demo_bytes({"w": g[0]}) == 8 * 32 * (256 // 64) * (192 // 64)
  assert sent * 64 == 256 * 192 * 4  # 64x fewer than float32 at the defaults


def test_demo_trains_and_refuses_bad_input(mesh8):
  batches = _batches(mesh8, 30)
  tx = jaxcomp.demo(0.01, compression_topk=4, compression_chunk=8)
  state = jaxcomp.init(tx, _params(), mesh8)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh8)
  losses = []
  for b in batches:
    state, loss = step(state, b)
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  for kw, name in [({"compression_decay": 1.0}, "compression_decay"),
                   ({"compression_topk": 0}, "compression_topk"),
                   ({"compression_chunk": 2.5}, "compression_chunk"),
                   ({"weight_decay": -1.0}, "weight_decay")]:
    with pytest.raises(ValueError, match=name):
      jaxcomp.demo(0.1, **kw)


def test_demo_statistics(mesh8):
  g = jax.random.normal(jax.random.key(14), (8, 256, 192))
  state = run_steps(jaxcomp.demo(0.1), {"w": g}, mesh8).state
  stats = jaxcomp.get_stats(state)
  assert float(stats.bytes_sent) == lowcomm.demo_bytes({"w": g[0]})
  assert float(stats.compression_factor) == 64.0
  assert float(stats.wire_bytes) == 7 * float(stats.bytes_sent)  # all-gather ring
  assert float(stats.state_bytes) == 4 * 256 * 192


def test_streaming_fragments_sync_on_staggered_steps(mesh8):
  # Two fragments ("b" then "w", in leaf order), H = 4: "b" syncs on steps
  # 4, 8 (1-based) and "w" two steps earlier, on steps 2, 6.
  tx = jaxcomp.diloco(optax.sgd(0.1), sync_every=4, fragments=2)
  state = jaxcomp.init(tx, _params(), mesh8, layout=ISLANDS)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh8, layout=ISLANDS, donate=False)
  traffic = jaxcomp.collective_traffic(step.lower(state, _batches(mesh8, 1)[0]).compile())
  branch = sum(o.operand_bytes for o in traffic.ops if o.in_branch)
  assert branch == 4 * (7 + 91) + 2 * 4  # each fragment once, with its flag
  for i, b in enumerate(_batches(mesh8, 8)):
    state, _ = step(state, b)
    for k, at in (("b", (3, 7)), ("w", (1, 5))):
      x = np.asarray(state.params[k])
      same = all(np.array_equal(x[0], x[d]) for d in range(8))
      assert same == (i in at), (k, i)
  st = state.opt_state
  assert len(st.outer_state) == len(st.exchange_state) == 2
  with pytest.raises(ValueError, match="fragments must be an integer in"):
    jaxcomp.diloco(optax.sgd(0.1), sync_every=4, fragments=5)
  with pytest.raises(ValueError, match="fragments=3 needs as many parameter leaves"):
    jaxcomp.init(jaxcomp.diloco(optax.sgd(0.1), sync_every=4, fragments=3), _params(), mesh8,
                 layout=ISLANDS)


def test_traffic_counts_each_fragments_syncs(mesh8):
  # Streaming DiLoCo, H = 4, F = 2, int8 blocks: after 6 steps "w" synced
  # twice (steps 2, 6) and "b" once (step 4); after 8, each twice. The
  # bytes per sync are what the compiled sync branch sends (less the
  # non-finite flags, which the statistics do not count).
  tx = jaxcomp.diloco(optax.sgd(0.1), sync_every=4, fragments=2, compressor="int8_block")
  state = jaxcomp.init(tx, _params(), mesh8, layout=ISLANDS)
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh8, layout=ISLANDS, donate=False)
  hlo = jaxcomp.collective_traffic(step.lower(state, _batches(mesh8, 1)[0]).compile())
  per_interval = sum(o.operand_bytes for o in hlo.ops if o.in_branch) - 2 * 4
  frag = [float(jaxcomp.get_stats(ex).bytes_sent)
          for ex in state.opt_state.exchange_state]  # b, w
  assert sum(frag) == per_interval
  t0 = lowcomm.traffic(state.opt_state)
  assert (t0.steps, t0.syncs, t0.total_bytes, t0.reduction) == (0, (0, 0), 0.0, float("inf"))
  batches = _batches(mesh8, 8)
  for i, b in enumerate(batches):
    state, _ = step(state, b)
    if i == 5:
      t6 = lowcomm.traffic(state.opt_state)
  assert t6.syncs == (1, 2)
  assert t6.total_bytes == frag[0] + 2 * frag[1]
  assert t6.bytes_per_step == t6.total_bytes / 6
  st = state.opt_state
  t8 = lowcomm.traffic(st)
  assert (t8.steps, t8.syncs) == (8, (2, 2))
  assert t8.bytes_per_interval == per_interval
  assert t8.bytes_per_step == per_interval / 4
  dense = 4 * sum(int(np.prod(s)) for s in SHAPES.values())
  assert t8.dense_bytes_per_step == dense
  assert t8.reduction == dense / (per_interval / 4)
  assert t8.total_wire_bytes > 0
  with pytest.raises(ValueError, match="expected one diloco state"):
    lowcomm.traffic((st, st))


def test_diloco_with_replicated_parameters_says_what_to_use(mesh8):
  # Placing the state traces DiLoCo's update with the parameters as given
  # (replicated), so the refusal comes at jaxcomp.init, before any step.
  tx = jaxcomp.diloco(optax.sgd(0.1), sync_every=2)
  with pytest.raises(ValueError, match=r"jaxcomp\.init\(\.\.\., layout=jaxcomp\.Islands\(\)\)"):
    jaxcomp.init(tx, _params(), mesh8)
  # The jit helper averages gradients: DiLoCo there is refused, naming its layout.
  grad_fn = jaxcomp.compressed_value_and_grad(_loss, tx, mesh8)
  with pytest.raises(ValueError, match=r"layout=jaxcomp\.Islands\(\)"):
    grad_fn.init(_params())


# -- DiLoCo in the user's idioms: a jit step, NNX, Orbax --------------------


def test_the_step_inside_a_users_jit_step_is_the_step(mesh8):
  """make_train_step's step called inside the user's own jax.jit step
  (beside their own use of the synchronized parameters) runs what it runs
  alone: the same parameters, state and losses, bit for bit."""
  tx = jaxcomp.diloco(optax.sgd(0.1, momentum=0.9), sync_every=3, compressor="int8_block",
                      bits=4)
  batches = _batches(mesh8, 5)
  _, ref_st, _, ref_hist = _run(tx, mesh8, batches)
  inner = jaxcomp.make_train_step(_loss, tx, mesh=mesh8, layout=ISLANDS, donate=False)
  state = jaxcomp.init(tx, _params(), mesh8, layout=ISLANDS)

  @jax.jit
  def train_step(state, batch):
    state, loss = inner(state, batch)
    shared = state.model_params()  # e.g. an evaluation of the shared model
    return state, loss, _loss(shared, batch)

  for b, (ref_w, ref_loss) in zip(batches, ref_hist):
    state, loss, shared_loss = train_step(state, b)
    np.testing.assert_array_equal(np.asarray(state.params["w"]), ref_w)
    assert float(loss) == ref_loss and np.isfinite(float(shared_loss))
  for x, y in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(ref_st)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # The step takes the state jaxcomp.init placed, and the Islands layout
  # wants a jaxcomp.diloco in tx.
  with pytest.raises(TypeError, match="jaxcomp.init"):
    inner(state.params, batches[0])
  with pytest.raises(ValueError, match="jaxcomp.diloco"):
    jaxcomp.init(optax.chain(jaxcomp.compressed_mean("identity", "data"), optax.sgd(0.1)),
                 _params(), mesh8, layout=ISLANDS)


def _nnx_model():
  from flax import nnx

  class Net(nnx.Module):

    def __init__(self, rngs):
      self.lin = nnx.Linear(13, 7, rngs=rngs)

    def __call__(self, x):
      return jnp.tanh(self.lin(x))

  return Net(nnx.Rngs(0))


def _nnx_step_as_functional(step, model, opt, ref_step, ref, batch):
  """One NNX DiLoCo step and one of the functional step it adapts: the same
  loss, each copy's parameters (``optimizer.local``) and the model on the
  synchronized ones. Returns the functional step's TrainState and the NNX
  step's local and model kernels (numpy)."""
  from flax import nnx
  loss = step(model, opt, batch)
  ref, ref_loss = ref_step(ref, batch)
  assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
  w_local = np.asarray(opt.local["lin"]["kernel"][...])
  np.testing.assert_allclose(w_local, np.asarray(ref.params["lin"]["kernel"]),
                             rtol=1e-6, atol=1e-7)
  w_model = np.asarray(nnx.state(model, nnx.Param)["lin"]["kernel"][...])
  np.testing.assert_allclose(
      w_model, np.asarray(lowcomm.synced_params(ref.opt_state)["lin"]["kernel"]),
      rtol=1e-6, atol=1e-7)
  return ref, w_local, w_model


def _nnx_loss(model, batch):
  x, y = batch
  return jnp.mean((model(x) - y) ** 2)


def test_nnx_diloco_trains_as_the_functional_step(mesh8, tmp_path):
  """jaxcomp.flax.Optimizer with jaxcomp.diloco: each device steps its own
  copy (optimizer.local), the model holds the synchronized parameters
  (changing only on sync steps), both equal to jaxcomp.make_train_step on
  the same function; with per_device_loss no collective runs between
  syncs; an Orbax checkpoint mid-interval resumes bit-exactly."""
  from flax import nnx
  import jaxcomp.flax
  tx = jaxcomp.diloco(optax.sgd(0.1, momentum=0.9), sync_every=3)
  model = _nnx_model()
  graphdef, params0 = nnx.split(model, nnx.Param)
  params0 = nnx.as_pure(params0)
  opt = jaxcomp.flax.Optimizer(model, tx, wrt=nnx.Param, mesh=mesh8, layout=ISLANDS)
  assert opt.local["lin"]["kernel"][...].shape == (8, 13, 7)
  step = jaxcomp.flax.train_step(_nnx_loss)
  fn_loss = lambda p, b: _nnx_loss(nnx.merge(graphdef, p), b)
  ref = jaxcomp.init(tx, params0, mesh8, layout=ISLANDS)
  ref_step = jaxcomp.make_train_step(fn_loss, tx, mesh=mesh8, layout=ISLANDS)
  batches = _batches(mesh8, 5)
  prev = np.asarray(nnx.state(model, nnx.Param)["lin"]["kernel"][...])
  for i, b in enumerate(batches[:4]):
    ref, w_local, w_model = _nnx_step_as_functional(step, model, opt, ref_step, ref, b)
    synced = (i + 1) % 3 == 0
    assert np.array_equal(w_model, prev) != synced, i  # moves on syncs only
    prev = w_model
    assert all(np.array_equal(w_local[0], w_local[d]) for d in range(8)) == synced, i
    if synced:
      np.testing.assert_array_equal(w_local[0], w_model)
  # per_device_loss: no collective outside the sync's branch.
  quiet = jaxcomp.flax.train_step(_nnx_loss, per_device_loss=True)
  traffic = jaxcomp.collective_traffic(quiet.lower(model, opt, batches[4]).compile())
  assert traffic.ops and not [o for o in traffic.ops if not o.in_branch]
  # Orbax, mid-interval (one step after the sync): resume bit-exactly.
  ckpt = jaxcomp.checkpoint.Checkpointer(tmp_path)
  ckpt.save(4, {"model": nnx.as_pure(nnx.state(model)),
                "opt": nnx.as_pure(nnx.state(opt))})
  assert quiet(model, opt, batches[4]).shape == (8,)
  fresh = _nnx_model()
  fresh_opt = jaxcomp.flax.Optimizer(fresh, tx, wrt=nnx.Param, mesh=mesh8, layout=ISLANDS)
  _, restored = ckpt.restore({"model": nnx.as_pure(nnx.state(fresh)),
                              "opt": nnx.as_pure(nnx.state(fresh_opt))})
  nnx.update(fresh, restored["model"])
  nnx.update(fresh_opt, restored["opt"])
  quiet(fresh, fresh_opt, batches[4])
  for x, y in zip(jax.tree.leaves(nnx.as_pure(nnx.state(opt))),
                  jax.tree.leaves(nnx.as_pure(nnx.state(fresh_opt)))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  with warnings.catch_warnings(), pytest.raises(
      ValueError, match="diloco, which FSDP cannot shard"):
    warnings.simplefilter("ignore", RuntimeWarning)  # the trace that placed it
    jaxcomp.flax.Optimizer(_nnx_model(), tx, wrt=nnx.Param, mesh=mesh8,
                           layout=jaxcomp.FSDP())
