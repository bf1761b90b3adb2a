"""A transform's configuration travels in its state: readable in any
process, through Orbax, and from checkpoints of the earlier format that held
a digest leaf instead."""

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import checkpoint

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture(autouse=True)
def standard_promotion():
  # optax.adam mixes int32 counts and floats, which strict promotion rejects.
  with jax.numpy_dtype_promotion("standard"):
    yield


def _fixture_run(mesh):
  """The run tests/data/checkpoint_v2 was written from (format 2, commit
  2dc43c0): a top-k 25% + Adam chain on 8 devices, params and state after
  two steps."""
  params = {"b": jnp.arange(4, dtype=jnp.float32) / 4,
            "w": jnp.linspace(-1, 1, 64, dtype=jnp.float32).reshape(16, 4)}
  # The fixture was written when "layerwise" was the default bucketing.
  tx = optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.25,
                                           bucketing="layerwise"),
                   optax.adam(1e-2))
  return tx, jaxcomp.init(tx, params, mesh)


def test_the_configuration_is_static_data_of_the_state(mesh8):
  _, state = _fixture_run(mesh8)
  state = state.opt_state
  leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  assert not any("config" in jax.tree_util.keystr(p) for p, _ in leaves)
  (path, config), = jaxcomp.transform_configs(state).items()
  assert path == "[0]"
  assert config["compressor"] == {"name": "topk", "ratio": 0.25,
                                  "max_ratio": None, "implementation": None,
                                  "value_bits": None}
  assert config["collective"]["name"] == "allgather"
  # Another ratio is another configuration, the same arrays' structure.
  other = jaxcomp.compressed_mean("topk", "data", ratio=0.5)
  s2 = jaxcomp.init(other, {"w": jnp.zeros(8)}, mesh8)
  assert jaxcomp.transform_configs(s2.opt_state)[""]["compressor"]["ratio"] == 0.5


def test_a_format_2_checkpoint_restores_bit_exactly(mesh8, tmp_path):
  if jax.device_count() != 8:
    pytest.skip("the fixture was written on 8 devices")
  directory = tmp_path / "ckpt"
  shutil.copytree(os.path.join(DATA, "checkpoint_v2"), directory)
  tx, state = _fixture_run(mesh8)
  target = {"params": state.params, "opt_state": state.opt_state}
  with checkpoint.Checkpointer(directory,
                               config={"fixture": "format 2"}) as ck:
    assert ck.metadata()["format"] == 2
    step, got = ck.restore(target)
  assert step == 2
  want = np.load(os.path.join(DATA, "checkpoint_v2_expected.npz"))
  flat = {jax.tree_util.keystr(k): v for k, v in
          jax.tree_util.tree_flatten_with_path(got)[0]}
  assert sorted(flat) == sorted(k for k in want.files if not k.endswith(
      ".config"))
  for k, v in flat.items():
    np.testing.assert_array_equal(np.asarray(v), want[k], err_msg=k)
  # The restored state is this process's transform's, and describable.
  assert jaxcomp.transform_configs(got["opt_state"])["[0]"]["seed"] == 0
  # It steps on (the residual was restored per device).
  def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((x @ p["w"] + p["b"][None] - y) ** 2)
  train = jaxcomp.make_train_step(loss_fn, tx, mesh=mesh8)
  x = jnp.sin(jnp.arange(32 * 16, dtype=jnp.float32)).reshape(32, 16)
  y = jnp.cos(jnp.arange(32 * 4, dtype=jnp.float32)).reshape(32, 4)
  batch = jax.device_put((x, y), NamedSharding(mesh8, P("data")))
  restored = dataclasses.replace(state, params=got["params"],
                                 opt_state=got["opt_state"])
  _, loss = train(restored, batch)
  assert np.isfinite(float(loss))


def test_a_format_2_checkpoint_of_another_config_is_refused(mesh8, tmp_path):
  directory = tmp_path / "ckpt"
  shutil.copytree(os.path.join(DATA, "checkpoint_v2"), directory)
  params = {"b": jnp.zeros(4), "w": jnp.zeros((16, 4))}
  tx = optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.5),
                   optax.adam(1e-2))
  state = jaxcomp.init(tx, params, mesh8)
  target = {"params": state.params, "opt_state": state.opt_state}
  with checkpoint.Checkpointer(directory,
                               config={"fixture": "format 2"}) as ck:
    with pytest.raises(checkpoint.CheckpointMismatchError,
                       match=r"compressor.ratio: 0.25 in the checkpoint .*, 0.5 in this run"):
      ck.restore(target)


def test_an_orbax_restored_state_is_described_in_a_fresh_process(tmp_path):
  """Orbax saves the state's arrays; a fresh process restores them into its
  own freshly initialised state and can describe every transform in it
  (nothing is looked up in a registry of the process that built it)."""
  script = textwrap.dedent(f"""
      import os, sys
      os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
      import jax, jax.numpy as jnp, optax, orbax.checkpoint as ocp
      import jaxcomp
      mesh = jax.make_mesh((8,), ("data",))
      tx = optax.chain(jaxcomp.compressed_mean("int8_block", "data", bits=4),
                       optax.sgd(0.1))
      state = jaxcomp.init(tx, {{"w": jnp.ones(300)}}, mesh).opt_state
      path = {str(tmp_path / "orbax")!r}
      ck = ocp.StandardCheckpointer()
      if sys.argv[1] == "save":
        ck.save(path, state)
        ck.wait_until_finished()
      else:
        restored = ck.restore(path, state)
        (config,) = jaxcomp.transform_configs(restored).values()
        print(config["compressor"]["name"], config["compressor"]["bits"],
              config["collective"]["name"])
      """)
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  for phase in ("save", "restore"):
    out = subprocess.run([sys.executable, "-c", script, phase], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["int8_block", "4", "auto"]
