"""jaxcomp.distributed in one process (8 simulated devices): checkpoint
round trip, refusal of mismatched checkpoints, device-count changes, the
consistency check, the global mesh and start-up arguments."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import checkpoint, distributed
from jaxcomp.distributed import _startup as distributed_startup
from jaxcomp._parts import concat as concat_parts

AXES = ("hosts", "devices")


@pytest.fixture(autouse=True)
def standard_promotion():
  # optax.adam mixes int32 counts and floats, which strict promotion rejects.
  with jax.numpy_dtype_promotion("standard"):
    yield


def _mesh(n):
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices")
  explicit = jax.sharding.AxisType.Explicit
  return Mesh(np.asarray(jax.devices()[:n], dtype=object).reshape(1, n), AXES,
              axis_types=(explicit, explicit))


def _loss(p, x, y):
  h = jax.nn.relu(x @ p["w1"])
  return jnp.mean((h @ p["w2"] - y) ** 2)


_SETUPS = {}


def _setup(n, compressor, hidden, ef, kw):
  """Mesh, initial state and jitted step, built once per configuration (the
  step is not donated, so the cached initial arrays stay valid)."""
  key = (n, compressor, hidden, ef, tuple(sorted(kw.items())))
  if key not in _SETUPS:
    mesh = _mesh(n)
    rng = np.random.default_rng(0)
    host = {"w1": rng.standard_normal((6, hidden)).astype(np.float32),
            "w2": rng.standard_normal((hidden, 1)).astype(np.float32)}
    params = distributed.global_array(host, mesh)
    tx = optax.chain(jaxcomp.compressed_mean(compressor, AXES,
                                             error_feedback=ef, **kw),
                     optax.adam(1e-2))
    opt_state, specs = jaxcomp.placement.init_sharded(tx, params, mesh, AXES)

    def step(p, s, batch):
      g = jaxcomp.per_device_grad(_loss, AXES)(p, *batch)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s, jnp.zeros(())

    _SETUPS[key] = (mesh, params, opt_state, jax.jit(jaxcomp.steps.shard_train_step(
        step, mesh=mesh, state_specs=specs, batch_spec=P(AXES))))
  return _SETUPS[key]


class Run:
  """A tiny regression MLP trained with compressed_mean on ``n`` devices."""

  def __init__(self, n, compressor="topk", hidden=8, ef=True, **kw):
    (self.mesh, self.params, self.opt_state,
     self._step) = _setup(n, compressor, hidden, ef, kw)
    self.fresh = {"params": self.params, "opt_state": self.opt_state}
    self.t = 0

  def steps(self, k):
    for _ in range(k):
      rng = np.random.default_rng(100 + self.t)
      batch = (rng.standard_normal((16, 6)).astype(np.float32),
               rng.standard_normal((16, 1)).astype(np.float32))
      self.params, self.opt_state, _ = self._step(
          self.params, self.opt_state,
          distributed.global_array(batch, self.mesh, P(AXES)))
      self.t += 1
    return self

  @property
  def state(self):
    return {"params": self.params, "opt_state": self.opt_state}


CONFIG = {"compressor": "topk", "ratio": 0.25, "error_feedback": True}


def _leaves_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_is_bit_exact_and_continues_identically(tmp_path):
  run = Run(4, ratio=0.25).steps(3)
  residuals = np.asarray(concat_parts(run.opt_state[0].feedback[0]))
  assert residuals.shape[0] == 4 and np.abs(residuals).sum() > 0
  assert not np.array_equal(residuals[0], residuals[1])  # per device
  with checkpoint.Checkpointer(tmp_path, config=CONFIG) as ckpt:
    ckpt.save(3, run.state)
    assert ckpt.all_steps() == [3]
    meta = ckpt.metadata()
    assert {k: meta["config"][k] for k in CONFIG} == CONFIG
    # The transform records its own configuration beside the caller's.
    assert meta["config"]["['opt_state'][0]: compressor.ratio"] == 0.25
    assert meta["device_count"] == 4
    assert meta["mesh"] == {"hosts": 1, "devices": 4}
    assert "P(('hosts', 'devices'),)" in {l["spec"] for l in meta["leaves"]}
    other = Run(4, ratio=0.25)  # fresh state: zero residuals, count 0
    step, state = ckpt.restore(other.fresh)
  assert step == 3
  _leaves_equal(state, run.state)
  for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(run.state)):
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
  other.params, other.opt_state, other.t = (state["params"],
                                            state["opt_state"], 3)
  other.steps(2)
  run.steps(2)
  _leaves_equal(other.state, run.state)


def test_other_compressor_config_is_refused_naming_it(tmp_path):
  run = Run(4, ratio=0.25).steps(1)
  checkpoint.Checkpointer(tmp_path, config=CONFIG).save(1, run.state)
  ckpt = checkpoint.Checkpointer(tmp_path, config={**CONFIG, "ratio": 0.5})
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"ratio: 0.25 in the checkpoint .*, 0.5 in this "
                     "run"):
    ckpt.restore(Run(4, ratio=0.5).fresh)
  qsgd = {"compressor": "qsgd", "levels": 4, "error_feedback": False}
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match="compressor: 'topk' in the checkpoint .*'qsgd' in "
                     "this run"):
    checkpoint.Checkpointer(tmp_path, config=qsgd).restore(
        Run(4, "qsgd", ef=False, levels=4).fresh)


def test_changed_hyperparameter_is_refused_without_a_written_config(tmp_path):
  """The transform records its own configuration: a run whose ratio changed
  (same state shapes) is refused on restore with no config written by hand,
  and the message names the hyperparameter."""
  run = Run(4, ratio=0.25).steps(1)
  checkpoint.Checkpointer(tmp_path).save(1, run.state)
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"\['opt_state'\]\[0\]: compressor\.ratio: 0\.25 in "
                     r"the checkpoint .*, 0\.5 in this run"):
    checkpoint.Checkpointer(tmp_path).restore(Run(4, ratio=0.5).fresh)
  assert jaxcomp.transform_configs(run.opt_state)[
      "[0]"]["compressor"]["ratio"] == 0.25


def test_other_state_structure_is_refused(tmp_path):
  run = Run(4, ratio=0.25).steps(1)
  checkpoint.Checkpointer(tmp_path).save(1, run.state)
  # No caller config at all: the transform's own configuration refuses a
  # run without error feedback (another compressor too), naming it.
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"error_feedback\.name: 'residual' in the checkpoint"):
    checkpoint.Checkpointer(tmp_path).restore(Run(4, "qsgd", ef=False).fresh)
  # The same transform around another tree: refused as another structure,
  # naming the leaf only the checkpoint has.
  target = Run(4, ratio=0.25).fresh
  target = {**target, "params": {"w1": target["params"]["w1"]}}
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"another state structure.*only in the checkpoint: "
                     r"\[\"\['params'\]\['w2'\]\""):
    checkpoint.Checkpointer(tmp_path).restore(target)


def test_other_shape_is_refused_naming_the_leaf(tmp_path):
  run = Run(4, ratio=0.25, hidden=8).steps(1)
  checkpoint.Checkpointer(tmp_path, config=CONFIG).save(1, run.state)
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"leaf \['params'\]\['w1'\] is float32\[6, 8\], "
                     r"this run expects float32\[6, 16\]"):
    checkpoint.Checkpointer(tmp_path, config=CONFIG).restore(
        Run(4, ratio=0.25, hidden=16).fresh)


def test_other_device_count_is_refused_or_averaged(tmp_path):
  run = Run(4, ratio=0.25).steps(3)
  checkpoint.Checkpointer(tmp_path, config=CONFIG).save(3, run.state)
  ckpt = checkpoint.Checkpointer(tmp_path, config=CONFIG)
  target = Run(8, ratio=0.25).fresh
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"per-device compression state .* for 4 devices .*"
                     r"this run has 8 devices"):
    ckpt.restore(target)
  step, state = ckpt.restore(target, on_topology_change="average")
  assert step == 3
  old = np.asarray(concat_parts(run.opt_state[0].feedback[0]))
  new = np.asarray(concat_parts(state["opt_state"][0].feedback[0]))
  assert old.shape[0] == 4 and new.shape[0] == 8
  # Every new device holds the mean residual: the pending mean update is kept.
  np.testing.assert_allclose(new, np.broadcast_to(old.mean(0), new.shape),
                             rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(new.mean(0), old.mean(0), rtol=1e-6, atol=1e-7)
  assert all(r.sharding.spec[0] == AXES for r in state["opt_state"][0].feedback[0])
  # Replicated leaves (params, key, count, Adam moments) are exact.
  _leaves_equal(state["params"], run.params)
  np.testing.assert_array_equal(np.asarray(state["opt_state"][0].key),
                                np.asarray(run.opt_state[0].key))
  _leaves_equal(state["opt_state"][1], run.opt_state[1])
  with pytest.raises(ValueError, match="on_topology_change"):
    ckpt.restore(target, on_topology_change="reshard")


def test_device_count_change_without_per_device_state_restores(tmp_path):
  run = Run(4, "identity", ef=False).steps(2)
  checkpoint.Checkpointer(tmp_path).save(2, run.state)
  step, state = checkpoint.Checkpointer(tmp_path).restore(
      Run(8, "identity", ef=False).fresh)
  assert step == 2
  _leaves_equal(state["params"], run.params)
  _leaves_equal(state["opt_state"][1], run.opt_state[1])
  got, want = state["opt_state"][0], run.opt_state[0]
  np.testing.assert_array_equal(np.asarray(got.key), np.asarray(want.key))
  assert int(got.count) == int(want.count) == 2
  # The per-device residual norm (a statistic that the next step rewrites)
  # now has one row per new device.
  assert got.stats.residual_norm.shape == (8,)


def test_missing_and_duplicate_steps(tmp_path):
  ckpt = checkpoint.Checkpointer(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="no checkpoint in"):
    ckpt.restore(Run(4).fresh)
  run = Run(4).steps(1)
  ckpt.save(1, run.state)
  with pytest.raises(FileNotFoundError, match=r"saved steps: \[1\]"):
    ckpt.restore(run.fresh, step=7)
  with pytest.raises(ValueError, match="step 1 is already saved"):
    ckpt.save(1, run.state)
  with pytest.raises(TypeError, match=r"state\['epoch'\] is a int"):
    ckpt.save(2, {**run.state, "epoch": 3})


def test_check_consistency_names_the_diverged_leaf():
  run = Run(4, ratio=0.25).steps(2)
  # Residuals differ per device and are skipped; replicated leaves agree.
  n = distributed.check_consistency(run.state)
  assert n == len([x for x in jax.tree.leaves(run.state)
                   if x.sharding.is_fully_replicated])
  w = run.params["w2"]
  shards = [jax.device_put(s.data + (1e-6 if i == 2 else 0.0), s.device)
            for i, s in enumerate(
                sorted(w.addressable_shards, key=lambda s: s.device.id))]
  bad = {**run.params, "w2": jax.make_array_from_single_device_arrays(
      w.shape, w.sharding, shards)}
  with pytest.raises(distributed.ConsistencyError,
                     match=r"params\['w2'\] differs between devices"):
    distributed.check_consistency(bad, name="params")


def test_global_mesh_shapes_and_bad_names():
  n = jax.device_count()
  mesh = distributed.global_mesh()
  assert mesh.axis_names == AXES and dict(mesh.shape) == {"hosts": 1,
                                                          "devices": n}
  assert dict(distributed.global_mesh(("data",)).shape) == {"data": n}
  for bad in [(), ("a", "a"), ("a", "b", "c"), ("",)]:
    with pytest.raises(ValueError, match="axis_names"):
      distributed.global_mesh(bad)


def test_initialize_from_env_single_process_and_bad_input(monkeypatch):
  for var in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
              distributed.ENV_PROCESS_ID, "SLURM_JOB_ID",
              "OMPI_MCA_orte_hnp_uri"):
    monkeypatch.delenv(var, raising=False)
  assert distributed.initialize_from_env() is False
  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
  with pytest.raises(ValueError, match="coordinator_address, num_processes "
                     "and process_id together"):
    distributed.initialize_from_env()
  with pytest.raises(ValueError, match=r"0 <= process_id < num_processes"):
    distributed.initialize_from_env("127.0.0.1:1", 2, 5)
  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
  with pytest.raises(ValueError, match="JAXCOMP_NUM_PROCESSES='two'"):
    distributed.initialize_from_env()


def test_hierarchical_identity_matches_flat_mean():
  """Exact pmean over 'devices', then compressed_mean over 'hosts' only."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  explicit = jax.sharding.AxisType.Explicit
  mesh = Mesh(np.asarray(jax.devices()[:8], dtype=object).reshape(2, 4), AXES,
              axis_types=(explicit, explicit))
  g = np.random.default_rng(1).standard_normal((8, 5)).astype(np.float32)
  tx = jaxcomp.compressed_mean("topk", "hosts", ratio=1.0)
  state, specs = jaxcomp.placement.init_sharded(tx, {"w": jnp.zeros(5)}, mesh, "hosts")
  assert specs.feedback[0] == (P("hosts"),)

  def body(g, s):
    g = lax.pmean({"w": g[0]}, "devices")
    u, s = tx.update(g, jaxcomp.placement.to_local(s, specs))
    return u, jaxcomp.placement.to_global(s, specs)

  u, _ = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXES), specs),
                               out_specs=(P(), specs)))(
      distributed.global_array(g, mesh, P(AXES)), state)
  np.testing.assert_allclose(np.asarray(u["w"]), g.mean(0), rtol=1e-6,
                             atol=1e-6)


def test_powersgd_q_round_trips_bit_exact(tmp_path):
  if "powersgd" not in jaxcomp.compressors.names():
    pytest.skip("PowerSGD is not registered in this checkout")
  run = Run(4, "powersgd", rank=2, hidden=32).steps(2)  # w1 (6, 32) is compressed
  exchange = run.opt_state[0].exchange_state
  qs = [x for x in jax.tree.leaves(exchange) if x.ndim == 2]
  assert qs and all(q.sharding.is_fully_replicated for q in qs)  # shared Q
  ckpt = checkpoint.Checkpointer(tmp_path, config={"compressor": "powersgd",
                                                    "rank": 2})
  ckpt.save(2, run.state)
  step, state = ckpt.restore(Run(4, "powersgd", rank=2, hidden=32).fresh)
  assert step == 2
  _leaves_equal(state, run.state)
  assert distributed.check_consistency(state) >= len(qs) + 2


@pytest.fixture
def recorded_initialize(monkeypatch):
  """Replaces jax.distributed.initialize with a recorder (no real job)."""
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize",
                      lambda **kw: calls.append(kw))
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  for var in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
              distributed.ENV_PROCESS_ID, distributed.ENV_HEARTBEAT,
              "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri"):
    monkeypatch.delenv(var, raising=False)
  return calls


def test_initialize_resolution_order(recorded_initialize, monkeypatch):
  calls = recorded_initialize
  monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:9")
  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "4")
  monkeypatch.setenv(distributed.ENV_PROCESS_ID, "3")
  monkeypatch.setenv(distributed.ENV_HEARTBEAT, "12")
  assert distributed.initialize_from_env(cpu_collectives=None)
  assert calls[-1]["coordinator_address"] == "127.0.0.1:9"
  assert (calls[-1]["num_processes"], calls[-1]["process_id"]) == (4, 3)
  assert calls[-1]["heartbeat_timeout_seconds"] == 12
  # Explicit arguments win over the environment.
  assert distributed.initialize_from_env("h:1", 2, 0, cpu_collectives=None,
                                         heartbeat_timeout_seconds=5)
  assert (calls[-1]["coordinator_address"], calls[-1]["num_processes"],
          calls[-1]["process_id"], calls[-1]["heartbeat_timeout_seconds"]
          ) == ("h:1", 2, 0, 5)
  for var in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
              distributed.ENV_PROCESS_ID):
    monkeypatch.delenv(var)
  # A SLURM job: JAX's auto-detection is asked (no address given) ...
  monkeypatch.setenv("SLURM_JOB_ID", "123")
  monkeypatch.setattr(distributed_startup, "_cluster_detected",
                      lambda: "SLURM_JOB_ID" in __import__("os").environ)
  assert distributed.initialize_from_env(cpu_collectives=None)
  assert calls[-1]["coordinator_address"] is None
  assert calls[-1]["num_processes"] is None
  # ... unless auto-detection is off: then it is a single-process run.
  n = len(calls)
  assert distributed.initialize_from_env(auto_detect=False,
                                         cpu_collectives=None) is False
  assert len(calls) == n


def _grid_run(shape, compressor, collective=None, steps=2, **kw):
  """compressed_mean on a ("hosts", "devices") mesh of ``shape``: the state
  after ``steps`` steps (or the fresh one), and its specs."""
  h, d = shape
  if jax.device_count() < h * d:
    pytest.skip(f"needs {h * d} devices")
  explicit = jax.sharding.AxisType.Explicit
  mesh = Mesh(np.asarray(jax.devices()[:h * d], dtype=object).reshape(h, d),
              AXES, axis_types=(explicit, explicit))
  rng = np.random.default_rng(0)
  params = distributed.global_array(
      {"w1": rng.standard_normal((6, 40)).astype(np.float32),
       "w2": rng.standard_normal((40, 1)).astype(np.float32)}, mesh)
  tx = optax.chain(jaxcomp.compressed_mean(compressor, AXES,
                                           collective=collective, **kw),
                   optax.sgd(1e-2))
  state = jaxcomp.init(tx, params, mesh, axis_name=AXES)
  step = jaxcomp.make_train_step(lambda p, b: _loss(p, *b), tx, mesh=mesh,
                                 axis_name=AXES, donate=False)
  for t in range(steps):
    r = np.random.default_rng(t)
    batch = (r.standard_normal((8 * h * d, 6)).astype(np.float32),
             r.standard_normal((8 * h * d, 1)).astype(np.float32))
    state, _ = step(state, distributed.global_array(batch, mesh, P(AXES)))
  return {"params": state.params, "opt_state": state.opt_state}


def _pending(state):
  """What every per-device leaf still owes the mean update, by its rule:
  the mean over the devices of an averaged leaf (residuals, Zen's
  overflow), the correction joined over the devices of a re-chunked one."""
  rules = checkpoint.topology_rules(state)
  mean, joined = [], []
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    rule = rules.get(jax.tree_util.keystr(path))
    if rule is None or ".stats" in jax.tree_util.keystr(path) or np.ndim(x) < 2:
      continue
    if rule == "rechunk":
      joined.append(np.asarray(x).reshape(-1))
    else:
      mean.append(np.asarray(x).mean(0))
  return mean, joined


@pytest.mark.parametrize("compressor,collective,kw", [
    ("topk", None, {"ratio": 0.25}),  # residuals: averaged
    ("qsgd", "two_phase", {}),  # second-phase residuals: re-chunked
    ("int8_block", "two_phase", {"block_size": 32}),
    ("fp8_block", "two_phase", {"block_size": 32}),
    ("topk", "zen", {"ratio": 0.25}),  # overflow: averaged
    ("powersgd", None, {"rank": 1, "min_compression_rate": 0.1}),
])
@pytest.mark.parametrize("new_shape", [(1, 4), (1, 2), (2, 4)])
def test_topology_change_keeps_the_pending_correction(
    tmp_path, compressor, collective, kw, new_shape):
  """From a 2x2 mesh onto 1x4, 1x2 and 2x4: every per-device leaf moves by
  its rule; the mean pending residual and the two-phase correction are
  kept; replicated leaves exactly."""
  saved = _grid_run((2, 2), compressor, collective, **kw)
  checkpoint.Checkpointer(tmp_path).save(2, saved)
  target = _grid_run(new_shape, compressor, collective, steps=0, **kw)
  _, got = checkpoint.Checkpointer(tmp_path).restore(
      target, on_topology_change="redistribute")
  (m_old, j_old), (m_new, j_new) = _pending(saved), _pending(got)
  assert len(m_old) == len(m_new) and len(j_old) == len(j_new)
  for a, b in zip(m_old, m_new):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
  for a, b in zip(j_old, j_new):  # the same correction, cut differently
    n = min(a.size, b.size)
    np.testing.assert_array_equal(b[:n], a[:n])
    assert not a[n:].any() and not b[n:].any()
  assert any(np.abs(x).sum() > 0 for x in m_old + j_old)
  _leaves_equal(got["params"], saved["params"])


def test_topology_change_refuses_state_without_a_rule(tmp_path):
  coll = jaxcomp.collectives.Hierarchical(fast="reduce_scatter",
                                          inner="two_phase")
  saved = _grid_run((2, 2), "qsgd", coll)
  checkpoint.Checkpointer(tmp_path).save(2, saved)
  target = _grid_run((1, 4), "qsgd", coll, steps=0)
  with pytest.raises(checkpoint.CheckpointMismatchError,
                     match=r"exchange_state.*cannot move to mesh.*hierarchical"):
    checkpoint.Checkpointer(tmp_path).restore(
        target, on_topology_change="redistribute")


def test_damaged_checkpoint_names_step_process_and_falls_back(tmp_path):
  """A truncated or missing shard is found before any array is read: the
  named step is refused with its process and file, and the default restore
  falls back to the newest complete step with a warning."""
  import glob
  import os
  run = Run(4, ratio=0.25).steps(1)
  ckpt = checkpoint.Checkpointer(tmp_path)
  ckpt.save(1, run.state)
  run.steps(1)
  ckpt.save(2, run.state)
  assert ckpt.damage(1) is None and ckpt.damage(2) is None
  (data,) = [f for f in glob.glob(str(tmp_path / "2" / "state" / "ocdbt.process_0"
                                      / "d" / "*"))][:1]
  with open(data, "r+b") as f:
    f.truncate(os.path.getsize(data) // 2)
  with pytest.raises(checkpoint.CheckpointDamagedError,
                     match=r"step 2 is damaged: process 0's file .* bytes, "
                     r"\d+ were written; the newest complete step is 1"):
    ckpt.restore(run.fresh, step=2)
  with pytest.warns(RuntimeWarning, match=r"step 2 is damaged.*restoring step 1"):
    step, _ = ckpt.restore(run.fresh)
  assert step == 1
  os.remove(data)
  assert "is missing" in ckpt.damage(2)
