"""EF21 and the feedback registry (DGC's feedback: test_compressors_dgc.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp import feedback
from jaxcomp._parts import concat as concat_parts
from tests.helpers import feedback_round, run_shard_map

N = 100


@pytest.fixture(scope="module")
def xs():
  return jnp.asarray(np.random.default_rng(0).normal(size=(8, N)), jnp.float32)


def test_ef21_by_hand_with_a_fake_exchange():
  # A bucket of two tensors, (2,) and (1,): the state has one array each.
  fb = feedback.EF21()
  zeros = (jnp.zeros(2), jnp.zeros(1))
  state = feedback.EF21State(local=zeros, shared=zeros)

  def halve(v):  # a "compressor" that sends half
    half = tuple(p / 2 for p in v)
    return half, half

  x = (jnp.asarray([4.0, -2.0]), jnp.asarray([8.0]))
  mean, state = feedback_round(fb, x, state, halve)
  np.testing.assert_array_equal(concat_parts(mean), [2.0, -1.0, 4.0])
  np.testing.assert_array_equal(concat_parts(state.local), [2.0, -1.0, 4.0])
  assert [p.shape for p in state.local] == [(2,), (1,)]
  mean, state = feedback_round(fb, x, state, halve)  # c = (x - g_i) / 2
  np.testing.assert_array_equal(concat_parts(mean), [3.0, -1.5, 6.0])
  np.testing.assert_array_equal(concat_parts(state.shared), concat_parts(mean))


def test_ef21_shared_estimate_is_the_mean_of_local_ones(mesh8, xs):
  tx = jaxcomp.compressed_mean("topk", "data", nonfinite="zero",
                               error_feedback="ef21", ratio=0.1)
  # A constant gradient: top-k of the difference sends 10 new coordinates
  # per step, so after 10 steps every g_i equals x_i and g the mean.
  errors = []
  for steps in (1, 5, 10):
    u, ref, state, _ = run_shard_map(tx, {"w": xs}, mesh8, steps=steps)
    st = state.feedback[0]
    assert isinstance(st, feedback.EF21State)
    np.testing.assert_allclose(np.asarray(concat_parts(st.shared)),
                               np.asarray(concat_parts(st.local)).mean(axis=0), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(u["w"]), np.asarray(concat_parts(st.shared)))
    errors.append(float(jnp.linalg.norm(u["w"] - ref["w"])))
  assert errors[0] > errors[1] > errors[2]
  assert errors[2] < 1e-5
  np.testing.assert_allclose(np.asarray(concat_parts(st.local)), np.asarray(xs), atol=1e-6)


def test_registry_resolves_the_variants():
  assert isinstance(feedback.get("ef21", biased=True), feedback.EF21)
  assert isinstance(feedback.get("dgc", biased=True), feedback.DGCFeedback)
  with pytest.raises(ValueError, match="ef21"):
    feedback.get("ef22", biased=True)
