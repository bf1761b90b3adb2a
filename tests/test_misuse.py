"""Misuse is caught at trace time or construction, with a message that
names what to do ([integration] item 5)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomp
from tests.helpers import (ZERO_SIZE_ARGS_CRASH, run_shard_map, sharded_update,
                           stacked)


def _loss(p, batch):
  return jnp.mean((batch @ p["w"]) ** 2)


def _batch(mesh, n=16, d=4):
  return jax.device_put(jax.random.normal(jax.random.key(0), (n, d)),
                        NamedSharding(mesh, P(mesh.axis_names[0])))


def test_plain_jax_grad_inside_shard_map_is_refused(mesh8):
  """Plain jax.value_and_grad of replicated parameters gives a gradient JAX
  already summed over the devices: refused, naming the helper to use."""
  tx = optax.chain(jaxcomp.compressed_mean("topk", "data"), optax.sgd(0.1))
  params = {"w": jnp.ones((4,))}
  state, specs = jaxcomp.placement.init_sharded(tx, params, mesh8, "data")

  def step(p, s, batch):
    loss, g = jax.value_and_grad(_loss)(p, batch)  # the trap
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, lax.pmean(loss, "data")

  f = jax.jit(jaxcomp.steps.shard_train_step(step, mesh=mesh8, state_specs=specs,
                                       batch_spec=P("data")))
  with pytest.raises(TypeError, match=r"per_device_value_and_grad.*'data'"):
    f(params, state, _batch(mesh8))


def test_axis_mismatch_names_both_axes():
  mesh = jax.make_mesh((8,), ("batch",))
  tx = jaxcomp.compressed_mean("topk", "data")
  with pytest.raises(NameError, match=r"'data' is not bound.*\('batch',\)"):
    jaxcomp.placement.init_sharded(tx, {"w": jnp.ones((4,))}, mesh, "batch")


@pytest.mark.parametrize("other,match", [
    ({"w": jnp.ones((5,))}, r"shape \(5,\).*needs \(4,\)"),
    ({"w": jnp.ones((4,)), "b": jnp.ones((2,))}, r"structure differs"),
])
def test_state_of_another_model_names_the_leaf(mesh8, other, match):
  tx = jaxcomp.compressed_mean("topk", "data")
  f, state, _ = sharded_update(tx, other, mesh8)
  with pytest.raises(ValueError, match=match):
    f(stacked({"w": jnp.ones((8, 4))}, mesh8), state)


@pytest.mark.parametrize("name,kwargs", [
    ("topk", {"ratio": float("nan")}), ("topk", {"ratio": float("inf")}),
    ("dgc", {"ratio": float("nan")}), ("random_k", {"ratio": float("nan")}),
    ("random_block", {"ratio": float("inf")}),
    ("threshold", {"threshold": float("inf")}),
    ("powersgd", {"min_compression_rate": float("nan")}),
    ("terngrad", {"clip_sigma": float("nan")}),
])
def test_non_finite_hyperparameters_are_refused_at_construction(name, kwargs):
  (param,) = kwargs
  with pytest.raises(ValueError, match=rf"{param} must be a finite number"):
    jaxcomp.compressed_mean(name, "data", **kwargs)


def _accumulator(per_device_init: bool):
  """A transform whose state sums the per-device gradients every other step,
  in a lax.cond that passes the state on unchanged in its other branch."""
  def init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return (jaxcomp.placement.to_varying(zeros, "data") if per_device_init else zeros,
            jnp.zeros((), jnp.int32))

  def update(updates, state, params=None):
    del params
    acc, count = state
    acc = jax.lax.cond(count % 2 == 0, lambda: jax.tree.map(jnp.add, acc, updates),
                       lambda: acc)
    return updates, (acc, count + 1)

  return optax.GradientTransformation(init, update)


def test_state_placement_names_the_cause_when_the_update_cannot_be_traced(mesh8):
  # The accumulator is invariant from init and per device after one branch
  # of the update's cond: JAX refuses the cond, and so would the step.
  # init_sharded says so, with JAX's error and the fix, instead of placing
  # the state by init's types alone.
  tx = optax.chain(_accumulator(False), jaxcomp.compressed_mean("topk", "data"))
  with pytest.raises(jaxcomp.PlacementError,
                     match=r"(?s)could not place the optimizer state.*"
                           r"TypeError.*lax\.cond.*jaxcomp\.placement\.to_varying") as e:
    jaxcomp.placement.init_sharded(tx, {"w": jnp.zeros(8)}, mesh8, "data")
  assert isinstance(e.value.__cause__, TypeError)  # JAX's own, chained
  # The fix the message names: init makes the accumulator per device.
  tx = optax.chain(_accumulator(True), jaxcomp.compressed_mean("topk", "data"))
  _, specs = jaxcomp.placement.init_sharded(tx, {"w": jnp.zeros(8)}, mesh8, "data")
  assert specs[0][0]["w"] == P("data") and specs[0][1] == P()


def test_optax_apply_if_finite_around_the_exchange_names_the_replacement(mesh8):
  # optax.apply_if_finite decides per device; around a compressed mean JAX
  # would refuse the step with a cond type error about manual axis types.
  # init_sharded (and everything built on it) says what to use instead.
  params = {"w": jnp.ones((16,))}
  inner = optax.chain(jaxcomp.compressed_mean("topk", "data"), optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"use jaxcomp\.apply_if_finite\(inner, axis_name"):
    jaxcomp.placement.init_sharded(optax.apply_if_finite(inner, 3), params, mesh8, "data")
  # Around the optimizer alone (after the exchange) it is fine: every
  # device sees the same averaged gradient.
  tx = optax.chain(jaxcomp.compressed_mean("topk", "data"),
                   optax.apply_if_finite(optax.sgd(0.1), 3))
  jaxcomp.placement.init_sharded(tx, params, mesh8, "data")


def test_one_door_the_retired_entry_points_are_gone():
  """0.1.0's API: one init, one shard_map step builder, one jax.jit
  value-and-grad and the layout values; the retired doors are not public
  (no shim resolves them)."""
  for name in ["init_sharded", "shard_train_step", "to_varying", "varying_axes",
               "to_local", "to_global", "state_partition_specs",
               "CompressedValueAndGrad", "sharding", "warmup", "jit", "inspect"]:
    assert not hasattr(jaxcomp, name), name
  for module, name in [("jaxcomp.fsdp", "init"), ("jaxcomp.fsdp", "make_train_step"),
                       ("jaxcomp.lowcomm", "init"), ("jaxcomp.lowcomm", "make_train_step"),
                       ("jaxcomp.lowcomm", "local_step"), ("jaxcomp.lowcomm", "PerDevice")]:
    assert not hasattr(importlib.import_module(module), name), (module, name)
  for module in ["jaxcomp.sharding", "jaxcomp.warmup", "jaxcomp.jit", "jaxcomp.inspect"]:
    with pytest.raises(ImportError):
      importlib.import_module(module)
  doors = [n for n in jaxcomp.__all__ if callable(getattr(jaxcomp, n))]
  assert [n for n in doors if n == "init" or n.endswith("train_step")] == [
      "init", "make_train_step"]
  assert {"DataParallel", "FSDP", "Islands", "TrainState",
          "compressed_value_and_grad"} <= set(jaxcomp.__all__)
  with pytest.raises(ValueError, match="unknown collective 'compressor'"):
    jaxcomp.compressed_mean("powersgd", "data", collective="compressor")


@pytest.mark.parametrize("kwargs", [
    dict(bucketing="whole"), dict(bucketing="layerwise"), dict(),
    dict(plan=[[0, 1]]), dict(plan=[[0], [1]]), dict(plan=[[0, 1, 2]]),
    dict(bucketing="whole", output="shard")])
@pytest.mark.parametrize("with_data", [False, True])
@pytest.mark.skipif(ZERO_SIZE_ARGS_CRASH,
                    reason="JAX 0.11's XLA crashes on any shard_map with a "
                    "zero-size argument and a collective (test_jax_bugs.py)")
def test_zero_size_leaves_of_mixed_dtypes_give_zero_size_updates(
    mesh8, kwargs, with_data):
  """Zero-size leaves (of different dtypes, alone or beside a leaf with
  data, in any bucketing or an explicit plan that names them) have nothing
  to compress: their updates are zero-size arrays of their own shapes and
  dtypes, and the leaf beside them gets its mean."""
  grads = {"a": jnp.zeros((8, 0), jnp.float32),
           "b": jnp.zeros((8, 0, 3), jnp.bfloat16)}
  if with_data:
    grads["c"] = jax.random.normal(jax.random.key(0), (8, 5))
  elif "plan" in kwargs and 2 in kwargs["plan"][-1]:
    return  # names a leaf that is not there
  tx = jaxcomp.compressed_mean("random_block", "data", ratio=0.01,
                               **{"error_feedback": False, **kwargs})
  if kwargs.get("output") == "shard":
    shards = jax.device_put(
        jax.tree.map(lambda g: jnp.zeros((8 * -(-g[0].size // 8),), g.dtype),
                     grads), NamedSharding(mesh8, P("data")))

    def body(g, s):
      return tx.update(jax.tree.map(lambda x: x[0], g), tx.init(s))[0]

    u = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("data"),
                              out_specs=P("data")))(
        jax.device_put(grads, NamedSharding(mesh8, P("data"))), shards)
    want = {k: ((8 * -(-g[0].size // 8),), g.dtype) for k, g in grads.items()}
  else:
    u = run_shard_map(tx, grads, mesh8)[0]
    want = {k: (g.shape[1:], g.dtype) for k, g in grads.items()}
  assert {k: (v.shape, v.dtype) for k, v in u.items()} == want
  if with_data:
    assert np.all(np.isfinite(np.asarray(u["c"])))


# The errors a new user met (issue one-door, item 9).


def test_jit_route_with_a_transform_over_other_axes_names_both():
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
  loss = lambda p, b: jnp.mean((b @ p["w"]) ** 2)
  grad_fn = jaxcomp.compressed_value_and_grad(
      loss, jaxcomp.compressed_mean("topk", "data"), mesh,
      axis_name=("data", "fsdp"))
  with pytest.raises(ValueError, match=r"(?s)axis_name=\('data', 'fsdp'\).*"
                                       r"compressed_mean averages over \['data'\]"):
    grad_fn.init({"w": jnp.ones((4,))})
  grad_fn = jaxcomp.compressed_value_and_grad(
      loss, jaxcomp.compressed_mean("topk", "tensor"), mesh)
  with pytest.raises(ValueError, match=r"(?s)axis_name='data'.*over \['tensor'\]"):
    grad_fn.init({"w": jnp.ones((4,))})


def test_a_state_made_for_another_compressor_names_the_difference(mesh8):
  params = {"w": jnp.ones((16,))}
  made = jaxcomp.init(optax.chain(jaxcomp.compressed_mean("topk", "data"),
                                  optax.sgd(0.1)), params, mesh8)
  tx = optax.chain(jaxcomp.compressed_mean("powersgd", "data"), optax.sgd(0.1))
  step = jaxcomp.make_train_step(lambda p, b: jnp.mean((b @ p["w"]) ** 2), tx,
                                 mesh=mesh8)
  batch = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh8, P("data")))
  with pytest.raises(ValueError, match=r"(?s)made for compressor .*'topk'.* "
                                       r"where this transform has .*'powersgd'"):
    step(made, batch)


def test_the_mask_advice_for_an_integer_leaf_works_through_make_train_step(mesh8):
  params = {"w": jnp.ones((16,)), "seen": jnp.zeros((), jnp.int32)}
  loss = lambda p, b: jnp.mean((b @ p["w"]) ** 2)
  batch = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh8, P("data")))
  unmasked = optax.chain(jaxcomp.compressed_mean("topk", "data"), optax.sgd(0.1))
  with pytest.raises(TypeError, match=r"dtype int32.*mask="):
    jaxcomp.init(unmasked, params, mesh8)
  tx = optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.25,
                                           mask={"w": True, "seen": False}),
                   optax.sgd(0.1))
  # optax.sgd scales the integer leaf's zero update by a float (a user's
  # default, standard promotion; the suite runs strict).
  with jax.numpy_dtype_promotion("standard"):
    state = jaxcomp.init(tx, params, mesh8)
    state, l = jaxcomp.make_train_step(loss, tx, mesh=mesh8)(state, batch)
  assert float(l) == 256.0
  assert int(state.params["seen"]) == 0 and state.params["seen"].dtype == jnp.int32
  # top-k sent 4 of 16 coordinates: the mean gradient is 32 each.
  assert int(jnp.sum(state.params["w"] != 1.0)) == 4


@pytest.mark.skipif(ZERO_SIZE_ARGS_CRASH,
                    reason="JAX 0.11's XLA:CPU crashes on zero-size shard_map "
                           "arguments with a collective (tests/test_jax_bugs.py)")
@pytest.mark.parametrize("layout", ["replicated", "fsdp", "islands"])
def test_zero_size_leaves_train_with_random_block_over_the_whole_model(mesh8, layout):
  """A zero-size parameter with random blocks and bucketing="whole" trains in
  every layout, its update empty (FSDP's all-gather of a zero-size shard
  failed to lower)."""
  params = {"w": jnp.ones((16,)), "z": jnp.zeros((0, 3))}
  loss = lambda p, b: jnp.mean((b @ p["w"]) ** 2) + jnp.sum(p["z"])
  kw = dict(ratio=0.5, bucketing="whole")
  tx, lay = {
      "replicated": (optax.chain(jaxcomp.compressed_mean("random_block", "data", **kw),
                                 optax.sgd(0.1)), jaxcomp.DataParallel()),
      "fsdp": (optax.chain(jaxcomp.compressed_mean("random_block", "data", output="shard",
                                                   **kw), optax.sgd(0.1)), jaxcomp.FSDP()),
      "islands": (jaxcomp.diloco(optax.sgd(0.1), sync_every=1, compressor="random_block",
                                 **kw), jaxcomp.Islands()),
  }[layout]
  state = jaxcomp.init(tx, params, mesh8, layout=lay)
  step = jaxcomp.make_train_step(loss, tx, mesh=mesh8, layout=lay)
  batch = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh8, P("data")))
  for _ in range(2):
    state, l = step(state, batch)
  whole = state.model_params()
  assert whole["z"].shape == (0, 3) and np.isfinite(float(l))
  assert float(jnp.sum(whole["w"] != 1.0)) > 0  # the model trained


@pytest.mark.parametrize("module,command", [("jaxcomp.launch", "launch"),
                                            ("jaxcomp.autotune", "autotune"),
                                            ("jaxcomp.elastic.launcher", "islands")])
def test_running_a_library_module_names_the_command_instead_of_exiting_0(module, command):
  import subprocess
  import sys

  r = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 1 and f"run `jaxcomp {command}" in r.stderr


def test_python_dash_m_jaxcomp_is_the_command_line():
  import subprocess
  import sys

  r = subprocess.run([sys.executable, "-m", "jaxcomp", "launch", "--help"],
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0 and r.stdout.startswith("usage: jaxcomp launch")
