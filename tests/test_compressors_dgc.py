"""DGC: sampled-threshold top-k, momentum correction and factor masking,
local clipping, and the exponential sparsity warm-up schedule."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp.compressors import (DGC, dgc_warmup_schedule, dgc_warmup_stages,
                                 dgc_warmup_steps)
from jaxcomp._parts import concat as concat_parts
from jaxcomp.feedback import DGCFeedback, DGCState
from tests.helpers import feedback_round, sharded_update, stacked

N = 4000


def test_selection_is_a_top_prefix_within_bounds():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(N,)), jnp.float32)
  comp = DGC(ratio=0.01, sample_ratio=0.05)
  k = 40
  order = np.argsort(-np.abs(np.asarray(x)))
  for seed in range(5):
    payload = jax.jit(comp.encode)(x, jax.random.key(seed))
    idx = np.asarray(payload["indices"])[np.asarray(payload["values"]) != 0]
    # Whatever the sampled threshold, what is sent is the m largest |x|,
    # with 0.8 k <= m <= k (the adjustment's bounds).
    assert 32 <= len(idx) <= k
    assert set(idx) == set(order[:len(idx)])
  assert comp.payload_bytes(N) == 8 * k


def _top1_exchange(v):
  """Sends the largest |entry| of the bucket (parts (2,) and (1,))."""
  flat = concat_parts(v)
  sent = jnp.zeros_like(flat).at[jnp.argmax(jnp.abs(flat))].set(1.0) * flat
  sent = (sent[:2], sent[2:])
  return sent, sent


def _parts(a):
  """A 3-element bucket of two tensors, (2,) and (1,)."""
  a = jnp.asarray(a, jnp.float32)
  return (a[:2], a[2:])


def test_momentum_correction_and_factor_masking_by_hand():
  fb = DGCFeedback(momentum=0.5)
  state = DGCState(momentum=_parts(jnp.zeros(3)), accumulation=_parts(jnp.zeros(3)))
  g1 = _parts([1.0, 0.5, -2.0])
  g2 = _parts([0.2, 1.0, 0.4])
  mean, state = feedback_round(fb, g1, state, _top1_exchange)
  # u = g1, v = g1; entry 2 (the second tensor) is sent; u and v are zeroed
  # there.
  np.testing.assert_array_equal(concat_parts(mean), [0.0, 0.0, -2.0])
  np.testing.assert_array_equal(concat_parts(state.momentum), [1.0, 0.5, 0.0])
  np.testing.assert_array_equal(concat_parts(state.accumulation), [1.0, 0.5, 0.0])
  mean, state = feedback_round(fb, g2, state, _top1_exchange)
  # u = 0.5 [1, .5, 0] + g2 = [.7, 1.25, .4]; v = [1, .5, 0] + u.
  np.testing.assert_allclose(concat_parts(mean), [0.0, 1.75, 0.0], rtol=1e-7)
  np.testing.assert_allclose(concat_parts(state.momentum), [0.7, 0.0, 0.4], rtol=1e-6)
  np.testing.assert_allclose(concat_parts(state.accumulation), [1.7, 0.0, 0.4], rtol=1e-6)


def test_local_clipping():
  # The norm is the bucket's, over both of its tensors: ||(3, 4)|| = 5.
  fb = DGCFeedback(momentum=0.0, clip_norm=1.0)
  state = DGCState(momentum=(jnp.zeros(1), jnp.zeros(1)),
                   accumulation=(jnp.zeros(1), jnp.zeros(1)))
  mean, _ = feedback_round(fb, (jnp.asarray([3.0]), jnp.asarray([4.0])), state, lambda v: (v, v))
  np.testing.assert_allclose(concat_parts(mean), [0.6, 0.8], rtol=1e-6)
  with pytest.raises(ValueError, match="momentum"):
    DGCFeedback(momentum=1.0)
  with pytest.raises(ValueError, match="clip_norm"):
    DGCFeedback(clip_norm=0.0)


def test_warmup_reaches_the_target_at_the_step_it_says():
  sched = dgc_warmup_schedule(final_ratio=0.001, stage_steps=10)
  at = dgc_warmup_steps(final_ratio=0.001, stage_steps=10)
  assert at == 40
  ratios = [float(sched(s)) for s in range(0, 60)]
  # 75%, 93.75%, 98.4375%, 99.6%, then 99.9% sparsity, ten steps each.
  np.testing.assert_allclose(ratios[0:40:10],
                             [0.25, 0.0625, 0.015625, 0.00390625], rtol=1e-6)
  assert ratios[at - 1] > 0.001
  assert all(r == pytest.approx(0.001) for r in ratios[at:])
  assert all(a >= b for a, b in zip(ratios, ratios[1:]))


def test_warmup_schedule_drives_compressed_mean(mesh8):
  # Identical gradients on all devices and no feedback: the update's support
  # is the largest per-device selection, in [0.8 k, k] for each step's k.
  def make(ratio):
    return jaxcomp.compressed_mean("dgc", "data", nonfinite="zero",
                                   error_feedback=False, ratio=ratio,
                                   max_ratio=0.25, sample_ratio=0.5)

  n = 1000
  tx = optax.inject_hyperparams(make)(
      ratio=dgc_warmup_schedule(final_ratio=0.01, stage_steps=1))
  f, state, _ = sharded_update(tx, {"w": jnp.zeros((n,))}, mesh8)
  x = np.random.default_rng(1).normal(size=(n,))
  g = stacked({"w": jnp.asarray(np.tile(x, (8, 1)), jnp.float32)}, mesh8)
  for k in (250, 63, 16, 10):
    u, state = f(g, state)
    nnz = int(jnp.sum(u["w"] != 0))
    assert int(np.ceil(0.8 * k)) <= nnz <= k, (k, nnz)


def test_bad_input():
  with pytest.raises(ValueError, match="ratio"):
    DGC(ratio=0.0)
  with pytest.raises(ValueError, match="sample_ratio"):
    DGC(sample_ratio=2.0)
  with pytest.raises(ValueError, match="decay"):
    dgc_warmup_schedule(decay=1.0)
  # A buffer smaller than k sends everything (documented pass-through).
  x = jnp.asarray([3.0, -1.0, 2.0])
  comp = DGC(ratio=1.0)
  np.testing.assert_array_equal(comp.decode(comp.encode(x, jax.random.key(0)),
                                            3, None), x)


def test_warmup_stages_are_the_schedules_distinct_values():
  sched = dgc_warmup_schedule(final_ratio=0.001, stage_steps=7)
  stages = dgc_warmup_stages(final_ratio=0.001, stage_steps=7)
  assert [s for s, _ in stages] == [0, 7, 14, 21, 28]
  assert stages[-1] == (dgc_warmup_steps(0.001, 7), 0.001)
  # Every step of a stage has the stage's ratio; the next stage differs.
  for (first, ratio), (nxt, _) in zip(stages, stages[1:] + [(35, None)]):
    for step in range(first, nxt):
      assert float(sched(step)) == pytest.approx(ratio, rel=1e-6)
  assert dgc_warmup_stages(final_ratio=0.3, stage_steps=5) == [(0, 0.3)]
  with pytest.raises(ValueError, match="stage_steps"):
    dgc_warmup_stages(final_ratio=0.01, stage_steps=0)
