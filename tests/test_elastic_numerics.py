"""The elastic islands' outer sync (jaxcomp.elastic._outer) is lowcomm's
DiLoCo: on the same pseudo-gradients, compressor and outer optimizer they
reach the same anchor and residual. Runs without torch: the islands' JAX
numerics import no torch, and neither does ``import jaxcomp.elastic``."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
import pytest

import jaxcomp
from jaxcomp import compressors
from jaxcomp import lowcomm
from jaxcomp.elastic import _outer
from jaxcomp.elastic import _shares

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"b": (16,), "w": (8, 8)}  # 80 elements, one buffer


def _loss(p, batch):
  # The gradient of each leaf is this device's batch row: the
  # pseudo-gradient of one inner SGD step of rate 1 is that row.
  return sum(jnp.sum(p[k] * batch[k].reshape(SHAPES[k])) for k in SHAPES)


def _rounds(mesh, n):
  out = []
  p = mesh.shape["data"]
  for r in range(n):
    keys = jax.random.split(jax.random.key(10 + r), len(SHAPES))
    out.append({k: jax.random.normal(kk, (p, *SHAPES[k])) * (r + 1.0)
                for kk, k in zip(keys, SHAPES)})
  return out


OUTERS = {"sgd": lambda: optax.sgd(1.0),
          "nesterov": lambda: optax.sgd(0.7, momentum=0.9, nesterov=True)}


@pytest.mark.parametrize("outer_name", sorted(OUTERS))
@pytest.mark.parametrize("name,kwargs", [("topk", {"ratio": 0.1}),
                                         ("int8_block", {"block_size": 32})])
def test_islands_outer_sync_is_lowcomms_diloco(mesh8, name, kwargs,
                                               outer_name):
  """One DiLoCo: ``jaxcomp.diloco`` over 8 devices (``sync_every=1``, one
  inner SGD step of rate 1, the buffer whole and all-gathered, residual
  error feedback) and 8 elastic islands running the islands' encode,
  rank-order decode-mean and outer step on the same interval end points
  reach the same anchor, and the same residual per island and device,
  over three syncs: the two share the pseudo-gradient and outer step
  (jaxcomp.lowcomm), the residual (jaxcomp.feedback) and the decode-sum
  (the compressor's), the same float32 operations in the same order.

  With plain SGD as the outer optimizer they agree bit for bit. With
  DiLoCo's Nesterov SGD an anchor entry may differ by a float32 ulp or
  so: the same operations are compiled by XLA in two programs (lowcomm's
  outer step fused inside the sync's ``lax.cond`` of its ``shard_map``,
  the island's alone in its own ``jit``), and the momentum's
  multiply-adds round differently in them; residuals then follow
  within the same rounding."""
  outer = OUTERS[outer_name]()
  inner = optax.sgd(1.0)
  params = {k: jax.random.normal(jax.random.key(i), s) * 0.5
            for i, (k, s) in enumerate(SHAPES.items())}
  tx = jaxcomp.diloco(inner, outer, sync_every=1, compressor=name,
                      collective="allgather", bucketing="whole",
                      error_feedback=True, **kwargs)
  state = jaxcomp.init(tx, params, mesh8, layout=jaxcomp.Islands())
  step = jaxcomp.make_train_step(_loss, tx, mesh=mesh8, layout=jaxcomp.Islands())

  comp = compressors.get(name, **kwargs)
  fb = _outer.feedback_for(True)
  key = jax.random.key(0)
  plan = _outer.plan_buffer(params, comp, key)
  encode, decode_mean, apply_mean = _outer.jitted(plan, comp, fb, outer)
  p = mesh8.shape["data"]
  anchor, outer_state = params, outer.init(params)
  residuals = [jnp.zeros((plan.n,), jnp.float32) for _ in range(p)]

  same = (np.testing.assert_array_equal if outer_name == "sgd" else
          lambda a, b, err_msg: np.testing.assert_allclose(
              a, b, rtol=1e-6, atol=1e-6, err_msg=err_msg))
  for grads in _rounds(mesh8, 3):
    batch = jax.device_put(grads, NamedSharding(mesh8, P("data")))
    state, _ = step(state, batch)
    payloads = []
    for d in range(p):
      g = {k: grads[k][d] for k in SHAPES}
      u, _ = inner.update(g, inner.init(anchor), anchor)
      island_local = optax.apply_updates(anchor, u)
      payload, residuals[d] = encode(anchor, island_local, residuals[d], key)
      payloads.append(payload)
    stacked = [jnp.stack(a) for a in zip(*payloads)]
    anchor, outer_state = apply_mean(anchor, outer_state,
                                     decode_mean(stacked, key))

    synced = lowcomm.synced_params(state.opt_state)
    parts = state.opt_state.exchange_state[0].feedback[0]  # per leaf, per device
    theirs = np.concatenate([np.asarray(x).reshape(p, -1) for x in parts],
                            axis=1)
    for k in SHAPES:
      same(np.asarray(synced[k]), np.asarray(anchor[k]), err_msg=k)
    same(theirs, np.stack(residuals), err_msg="residual")
  assert any(np.any(np.asarray(r) != 0) for r in residuals)


def test_the_buffer_travels_in_its_leaves_dtype():
  """As a bucket of compressed_mean: bf16 leaves encode a bf16 buffer,
  mixed ones a float32 buffer."""
  comp = compressors.get("int8_block")
  key = jax.random.key(0)
  bf16 = {"a": jnp.zeros((4,), jnp.bfloat16), "b": jnp.zeros((3,), jnp.bfloat16)}
  assert _outer.plan_buffer(bf16, comp, key).dtype == jnp.bfloat16
  mixed = {**bf16, "c": jnp.zeros((2,), jnp.float32)}
  plan = _outer.plan_buffer(mixed, comp, key)
  assert plan.dtype == jnp.float32 and plan.n == 9
  assert plan.sizes == (4, 3, 2)


def test_jaxcomp_imports_without_torch():
  """jaxcomp, jaxcomp.elastic and its launcher import without torch and
  torchft; making a Lighthouse (or an island) says which extra to
  install."""
  code = ("import sys; sys.modules['torch'] = None; "
          "sys.modules['torchft'] = None\n"
          "import jaxcomp, jaxcomp.lowcomm, jaxcomp.launch, jaxcomp.checkpoint\n"
          "import jaxcomp.elastic, jaxcomp.elastic.launcher\n"
          "try:\n  jaxcomp.elastic.lighthouse()\nexcept ImportError as e:\n"
          "  print('ERR', e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT,
                            "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-2000:]
  assert "ERR" in out.stdout and "jaxcomp[elastic]" in out.stdout, out.stdout


# Shares and shards (jaxcomp.elastic._shares): three islands of two
# processes each, simulated here process by process (each process's share
# encoded, "all-gathered" with the same share of the other islands,
# decoded; the island's mean shares gathered where its processes need
# them) against the whole payload of one-process islands.
SHARE_SHAPES = {"b": (64,), "w": (32, 4)}  # 192 elements


def _whole(shape):
  return tuple((0, n) for n in shape)


def _rows(shape, p, m):
  rows = shape[0] // m
  return ((p * rows, (p + 1) * rows), *_whole(shape)[1:])


def _share_islands(comp, outer, params, locals_, rounds, boxes):
  """The anchor (whole leaves), each process's payload bytes and whether
  any process needed the island's gather, after ``rounds`` syncs of
  islands whose process ``p`` holds ``boxes[l][p]`` of leaf ``l``."""
  m = len(boxes[0])
  shapes = [np.shape(x) for x in jax.tree.leaves(params)]
  treedef = jax.tree.structure(params)
  key = jax.random.key(0)
  fb = _outer.feedback_for(True)
  procs = []
  for p in range(m):
    lay = _shares.layout_of(boxes, shapes, p)
    cut = lambda tree, lay=lay: jax.tree.unflatten(treedef, [
        jnp.asarray(np.asarray(x)[tuple(slice(a, b) for a, b in s.box)])
        for x, s in zip(jax.tree.leaves(tree), lay.mine)])
    anchor = cut(params)
    share_plan, held_plan = _shares.plans(lay, anchor, comp, key)
    procs.append(dict(
        lay=lay, cut=cut, anchor=anchor, state=outer.init(anchor),
        plan=share_plan,
        fns=_shares.jitted(lay, share_plan, held_plan, comp, fb, outer),
        residuals=[jnp.zeros((share_plan.n,), jnp.float32)
                   for _ in locals_[0]]))
  for r in range(rounds):
    means = []
    for q in procs:
      enc, dec, _ = q["fns"]
      payloads = []
      for i, local in enumerate(locals_[r]):
        payload, q["residuals"][i] = enc(q["anchor"], q["cut"](local),
                                         q["residuals"][i], key)
        payloads.append(payload)
      means.append(np.asarray(dec([jnp.stack(a) for a in zip(*payloads)],
                                  key)))
    for q in procs:
      held_mean = (_shares.assemble(q["lay"], means)
                   if q["lay"].needs_gather else means[q["lay"].index])
      q["anchor"], q["state"] = q["fns"][2](q["anchor"], q["state"],
                                            jnp.asarray(held_mean))
  full = [np.zeros(s, np.float32) for s in shapes]
  for q in procs:
    for f, x, s in zip(full, jax.tree.leaves(q["anchor"]), q["lay"].mine):
      f[tuple(slice(a, b) for a, b in s.box)] = np.asarray(x)
  return (jax.tree.unflatten(treedef, full),
          [q["plan"].payload_bytes for q in procs],
          any(q["lay"].needs_gather for q in procs))


def _share_case():
  comp = compressors.get("int8_block", block_size=32)
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  rng = np.random.default_rng(0)
  params = {k: (rng.normal(size=s) * 0.5).astype(np.float32)
            for k, s in SHARE_SHAPES.items()}
  locals_ = [[{k: params[k] + (rng.normal(size=s) * (r + 1.0)).astype(
      np.float32) for k, s in SHARE_SHAPES.items()}
      for _ in range(3)] for r in range(2)]
  return comp, outer, params, locals_


def test_island_shares_and_fsdp_shards_reach_the_whole_payloads_anchor():
  """Each process of a replicated 2-process island sends half the payload
  (int8, one scale per 32 elements: 108 of 216 bytes), and the islands
  reach the anchor of the whole payload bit for bit (the shares' blocks
  are the whole buffer's). Each process of a 2-process FSDP island (rows
  of every leaf) sends its own block's share and steps it without
  gathering anything, and reaches the replicated island's anchor within
  1e-6."""
  comp, outer, params, locals_ = _share_case()
  whole, whole_bytes, _ = _share_islands(
      comp, outer, params, locals_, 2,
      [[_whole(s)] for s in SHARE_SHAPES.values()])
  halves, share_bytes, gathered = _share_islands(
      comp, outer, params, locals_, 2,
      [[_whole(s)] * 2 for s in SHARE_SHAPES.values()])
  assert whole_bytes == [216] and share_bytes == [108, 108]
  assert gathered  # replicated: the island gathers its mean shares
  for k in SHARE_SHAPES:
    np.testing.assert_array_equal(np.asarray(halves[k]),
                                  np.asarray(whole[k]), err_msg=k)
  assert not np.array_equal(np.asarray(whole["w"]), np.asarray(params["w"]))
  sharded, shard_bytes, gathered = _share_islands(
      comp, outer, params, locals_, 2,
      [[_rows(s, p, 2) for p in range(2)] for s in SHARE_SHAPES.values()])
  assert not gathered and shard_bytes == [108, 108]
  for k in SHARE_SHAPES:
    np.testing.assert_allclose(np.asarray(sharded[k]),
                               np.asarray(halves[k]), rtol=0, atol=1e-6,
                               err_msg=k)


def test_share_layouts_and_residuals():
  """Parts split each held block among its holders in process order; a
  residual's shares make the whole buffer's and back; a process holding
  two rectangles, or overlapping unequal blocks, is refused."""
  shapes = [(5,), (2, 3)]
  lays = [_shares.layout_of([[_whole(s)] * 3 for s in shapes], shapes, p)
          for p in range(3)]
  assert [[(s.start, s.stop) for s in lay.mine] for lay in lays] == [
      [(0, 1), (0, 2)], [(1, 3), (2, 4)], [(3, 5), (4, 6)]]
  whole = np.arange(11, dtype=np.float32)
  shares = [_shares.own_residual(lay, whole) for lay in lays]
  assert [s.tolist() for s in shares] == [[0, 5, 6], [1, 2, 7, 8],
                                          [3, 4, 9, 10]]
  np.testing.assert_array_equal(_shares.whole_residual(lays[1], shares),
                                whole)
  fsdp = _shares.layout_of([[((0, 1), (0, 3)), ((1, 2), (0, 3))]],
                           [(2, 3)], 1)
  assert fsdp.sharded and not fsdp.needs_gather
  assert (fsdp.mine[0].start, fsdp.mine[0].stop) == (0, 3)
  with pytest.raises(ValueError, match="overlapping"):
    _shares.layout_of([[((0, 2),), ((1, 3),)]], [(3,)], 0)
  with pytest.raises(ValueError, match="rectangular"):
    _shares._box_of([(slice(0, 1), slice(0, 1)), (slice(1, 2), slice(1, 2))],
                    (2, 2))
