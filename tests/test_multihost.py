"""Multi-process jobs with real processes: 2 processes x 2 CPU devices over
gloo, launched by jaxcomp.launch, against 1 process x 4 devices; checkpoint,
kill and resume; a killed process stops the job; cross-process collectives
and the consistency check.

Every subprocess runs under a timeout, so no test can hang.
"""

import os
import signal
import subprocess
import sys
import textwrap
import re
import time
import warnings

import jax
import numpy as np
import pytest

from jaxcomp import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "multihost", "train_mlp.py")
STEPS = 12
SAVE_EVERY = 5
JOB_TIMEOUT = 240  # seconds; a job that runs longer fails the test
BASE = ["--steps", str(STEPS), "--compressor", "topk", "--ratio", "0.1",
        "--error-feedback", "on", "--batch-size", "32"]


_CACHE = {}


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
  """One persistent compilation cache for this module's processes: the same
  programs are compiled once instead of once per launch (a cached executable
  computes exactly what a fresh compile would)."""
  _CACHE["dir"] = str(tmp_path_factory.mktemp("jax_cache"))
  yield
  _CACHE.clear()


def _clean_env():
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCOMP_")}
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  if "dir" in _CACHE:
    env.update(JAX_COMPILATION_CACHE_DIR=_CACHE["dir"],
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
  return env


class _Out:
  """Collects the launcher's prefixed output (written from threads)."""

  def __init__(self):
    self.parts = []

  def write(self, s):
    self.parts.append(s)

  def flush(self):
    pass

  @property
  def text(self):
    return "".join(self.parts)


def _job(args, n=2, devices=2, **kw):
  out = _Out()
  kw.setdefault("timeout", JOB_TIMEOUT)
  res = launch.launch([sys.executable, SCRIPT, *args], n,
                      devices_per_process=devices, env=_clean_env(),
                      stdout=out, **kw)
  return res, out.text


def _params(folder, pid):
  with np.load(os.path.join(folder, f"params.p{pid}.npz")) as f:
    return {k: f[k] for k in f.files}


def _assert_bitwise_equal(a, b):
  assert sorted(a) == sorted(b)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """2 processes x 2 devices, STEPS steps, consistency checked every 4."""
  out = str(tmp_path_factory.mktemp("uninterrupted"))
  res, log = _job([*BASE, "--output", out, "--check-every", "4"])
  assert res.returncode == 0, log
  return out, log


def test_two_processes_agree_and_match_one_process(uninterrupted, tmp_path):
  out, log = uninterrupted
  assert log.count("consistency check passed") == 2 * (STEPS // 4), log
  p0, p1 = _params(out, 0), _params(out, 1)
  _assert_bitwise_equal(p0, p1)  # every process holds the same parameters
  # The same steps on 1 process x 4 devices (same mesh order, same batches).
  env = _clean_env()
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(
      [*flags, "--xla_force_host_platform_device_count=4"]))
  single = str(tmp_path / "single")
  r = subprocess.run([sys.executable, SCRIPT, *BASE, "--output", single],
                     env=env, capture_output=True, text=True,
                     timeout=JOB_TIMEOUT)
  assert r.returncode == 0, r.stdout + r.stderr
  assert "mesh {'hosts': 1, 'devices': 4}" in r.stdout
  ref = _params(single, 0)
  for k in ref:  # float32, only the reduction order may differ
    np.testing.assert_allclose(p0[k], ref[k], rtol=1e-5, atol=1e-6,
                               err_msg=k)


def test_kill_every_process_then_resume_is_bit_exact(uninterrupted, tmp_path):
  ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
  args = [*BASE, "--checkpoint-dir", ckpt, "--save-every", str(SAVE_EVERY),
          "--output", out]
  crash = SAVE_EVERY + 3  # after the checkpoint of step 5, before step 10's
  res, log = _job([*args, "--crash-at-step", str(crash)])
  assert res.returncode != 0, log
  assert all(c is not None and c != 0 for c in res.returncodes), res
  assert sorted(os.listdir(ckpt)) == [str(SAVE_EVERY)], os.listdir(ckpt)
  assert not os.path.exists(out)
  res, log = _job([*args, "--resume"])
  assert res.returncode == 0, log
  assert log.count(f"resumed from step {SAVE_EVERY}") == 2, log
  _assert_bitwise_equal(_params(out, 0), _params(uninterrupted[0], 0))
  _assert_bitwise_equal(_params(out, 1), _params(uninterrupted[0], 1))


def _assert_own_last_words(text, lost, step, me=0):
  """The survivor's one line names the lost process and the checkpoint, and
  JAX's abort (a C++ check failure and its stack trace) never came."""
  lines = [l for l in text.splitlines()
           if "jaxcomp: process" in l and "stopped answering" in l]
  assert len(lines) == 1, text
  assert f"process {lost} of 2 stopped answering" in lines[0], lines
  assert (f"last complete checkpoint is step {step}" in lines[0]
          if step is not None else "no checkpoint" in lines[0]), lines
  assert f"stopping process {me} with exit status 75" in lines[0], lines
  for jax_abort in ("Check failure stack trace", "Terminating process because",
                    "SIGABRT"):
    assert jax_abort not in text, text


def test_kill_one_process_survivor_stops_checkpoint_resumes(uninterrupted,
                                                            tmp_path):
  ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
  args = [*BASE, "--checkpoint-dir", ckpt, "--save-every", str(SAVE_EVERY),
          "--output", out]
  # Process 1 dies; the launcher waits up to 60 s for process 0 to stop by
  # itself (its peer watcher: JAX's heartbeat, 10 s by default) before it
  # would terminate it.
  res, log = _job([*args, "--crash-at-step", "7", "--crash-process", "1"],
                  grace=60)
  assert res.returncode == 128 + 9, (res, log)
  assert res.failed == 1 and res.returncodes[1] == -9, res
  assert res.returncodes[0] == 75, (res, log)  # the watcher's status
  assert res.terminated == [], res  # it stopped on its own
  assert res.exit_times[0] - res.exit_times[1] <= 15, res
  _assert_own_last_words(log, lost=1, step=SAVE_EVERY)
  assert "process 1 (pid" in res.message and "SIGKILL" in res.message
  assert "exit code 75 (it lost a peer)" in res.message, res.message
  assert sorted(os.listdir(ckpt)) == [str(SAVE_EVERY)]
  res, log = _job([*args, "--resume"])
  assert res.returncode == 0, log
  assert "stopped answering" not in log, log
  _assert_bitwise_equal(_params(out, 0), _params(uninterrupted[0], 0))


def _slurm_env(pid, port, devices=2):
  """What SLURM (srun -n 2) sets for task ``pid``, and the coordinator
  address JAX reads itself (JAX_COORDINATOR_ADDRESS): no JAXCOMP_*
  variable, no launcher."""
  env = _clean_env()
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env.update(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="127.0.0.1",
             SLURM_NTASKS="2", SLURM_PROCID=str(pid), SLURM_LOCALID="0",
             SLURM_STEP_NUM_NODES="1",
             JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
             JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", XLA_FLAGS=" ".join(
                 [*flags, f"--xla_force_host_platform_device_count={devices}"]))
  return env


def test_survivor_without_the_launcher_names_the_lost_process(tmp_path):
  """Two processes started as SLURM starts them (no jaxcomp launcher):
  process 1 is SIGKILLed before step 7; process 0 exits by itself within
  15 s, status 75, with one line naming process 1 and the step 5
  checkpoint, and no SIGABRT stack trace."""
  ckpt = str(tmp_path / "ckpt")
  port = launch.free_port()
  procs = [subprocess.Popen(
      [sys.executable, SCRIPT, *BASE, "--checkpoint-dir", ckpt,
       "--save-every", str(SAVE_EVERY), "--crash-at-step", "7",
       "--crash-process", "1"], env=_slurm_env(i, port),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  logs = [None, None]
  try:
    deadline = time.monotonic() + JOB_TIMEOUT
    exits = [None, None]
    while None in exits and time.monotonic() < deadline:
      for i, p in enumerate(procs):
        if exits[i] is None and p.poll() is not None:
          exits[i] = time.monotonic()
      time.sleep(0.05)
    logs = [p.communicate(timeout=30)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert procs[1].returncode == -9, logs[1]
  assert "process 0/2: mesh {'hosts': 2, 'devices': 2}" in logs[0], logs[0]
  assert procs[0].returncode == 75, logs[0]
  assert exits[0] - exits[1] <= 15, exits
  _assert_own_last_words(logs[0], lost=1, step=SAVE_EVERY)


_WATCHED = r"""
import os, sys, time
from jaxcomp import distributed
distributed.initialize_from_env()
import jax, numpy as np
from jax.sharding import PartitionSpec as P
pid, case = jax.process_index(), sys.argv[1]
mesh = distributed.global_mesh(("hosts", "devices"))
x = distributed.global_array(np.ones((4, 8), np.float32), mesh,
                             P(("hosts", "devices")))
total = jax.jit(lambda v: v.sum())
for step in range(10_000):
  assert float(total(x)) == 32.0  # a collective across both processes
  if step == 3:
    if case == "finish_apart":
      if pid == 0:
        time.sleep(4)  # process 1 ends first: not a death
      print(f"process {pid} finished", flush=True)
      break
    if case == "raise" and pid == 1:
      raise RuntimeError("process 1 fails")
    if case == "kill_coordinator" and pid == 0:
      os.kill(os.getpid(), 9)
  time.sleep(0.05)
"""


@pytest.mark.parametrize("case", ["finish_apart", "raise"])
def test_peer_watcher_tells_an_exit_from_a_death(case):
  """A process that finishes 4 s before the other is not taken for dead
  (both wait at a barrier at exit, both exit 0); one that ends with an
  uncaught exception leaves at once, and the survivor, stuck in a
  collective, stops within seconds naming it."""
  out = _Out()
  res = launch.launch([sys.executable, "-c", _WATCHED, case], 2,
                      devices_per_process=2, env=_clean_env(), stdout=out,
                      timeout=120, grace=60)
  if case == "finish_apart":
    assert res.returncodes == [0, 0], out.text
    assert out.text.count("finished") == 2, out.text
    assert "stopped answering" not in out.text, out.text
    return
  assert res.returncodes == [75, 1], (res, out.text)
  assert "RuntimeError: process 1 fails" in out.text, out.text
  assert res.exit_times[0] - res.exit_times[1] < 5, res
  _assert_own_last_words(out.text, lost=1, step=None)


def test_coordinator_death_is_still_jax_abort():
  """What no public JAX hook lets jaxcomp change: when process 0, which
  hosts JAX's coordination service, dies, JAX's client aborts the others at
  once (SIGABRT, "Terminating process because the JAX distributed service
  detected fatal errors" and a C++ stack trace) before any Python code can
  run. ``jax.distributed.initialize`` does not pass a
  ``missed_heartbeat_callback`` to the client it makes; this test shows the
  behaviour, and fails when JAX changes it."""
  out = _Out()
  res = launch.launch([sys.executable, "-c", _WATCHED, "kill_coordinator"], 2,
                      devices_per_process=2, env=_clean_env(), stdout=out,
                      timeout=120, grace=60)
  assert res.failed == 0 and res.returncodes[0] == -9, res
  assert res.returncodes[1] == -signal.SIGABRT, (res, out.text)
  assert "Terminating process because the JAX distributed service" in out.text
  assert res.exit_times[1] - res.exit_times[0] < 5, res


def test_launcher_cli_tears_down_the_job_when_one_process_dies():
  child = ("import os, sys, time\n"
           "pid = int(os.environ['JAXCOMP_PROCESS_ID'])\n"
           "assert os.environ['JAXCOMP_NUM_PROCESSES'] == '3'\n"
           "assert os.environ['JAXCOMP_COORDINATOR_ADDRESS'].startswith("
           "'127.0.0.1:')\n"
           "time.sleep(0.5)\n"
           "sys.exit(3) if pid == 1 else time.sleep(600)\n")
  r = subprocess.run(
      [sys.executable, "-m", "jaxcomp.cli", "launch", "-n", "3", "--grace", "0",
       "--", sys.executable, "-c", child], capture_output=True, text=True,
      timeout=60, env=_clean_env())
  assert r.returncode == 3, r.stderr
  assert "process 1 (pid" in r.stderr and "exit code 3" in r.stderr, r.stderr
  assert "terminated by the launcher" in r.stderr, r.stderr


def test_launcher_timeout_and_success():
  ok = launch.launch([sys.executable, "-c", "print('hi')"], 2, stdout=_Out(),
                     env=_clean_env(), timeout=60)
  assert ok.returncode == 0 and ok.returncodes == [0, 0], ok
  slow = launch.launch([sys.executable, "-c", "import time; time.sleep(60)"],
                       2, stdout=_Out(), env=_clean_env(), timeout=1)
  assert slow.returncode == 124 and slow.seconds < 30, slow
  assert slow.terminated == [0, 1]


@pytest.mark.parametrize("kw,match", [
    (dict(num_processes=0), "num_processes"),
    (dict(devices_per_process=0), "devices_per_process"),
    (dict(grace=-1), "grace"),
    (dict(port=70000), r"port must be in 1\.\.65535"),
    (dict(port=0), r"port must be in 1\.\.65535"),
    (dict(heartbeat_timeout=0), "heartbeat_timeout must be >= 1"),
    (dict(heartbeat_timeout=-5), "heartbeat_timeout must be >= 1"),
])
def test_launcher_bad_input(kw, match):
  kw = {"num_processes": 2, **kw}
  with pytest.raises(ValueError, match=match):
    launch.launch(["true"], kw.pop("num_processes"), **kw)
  with pytest.raises(ValueError, match="command is empty"):
    launch.launch([], 2)


def test_launcher_refuses_a_port_in_use_and_shows_the_separator():
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    busy = s.getsockname()[1]
    with pytest.raises(ValueError, match=f"port {busy} on 127.0.0.1 is in use"):
      launch.launch(["true"], 2, port=busy)
  r = subprocess.run([sys.executable, "-m", "jaxcomp.cli", "launch", "--help"],
                     capture_output=True, text=True, timeout=60,
                     env=_clean_env())
  assert "-- command" in r.stdout.splitlines()[0], r.stdout


@pytest.mark.parametrize("address", ["nohost", "host:", ":1234",
                                     "host:70000", "host:port"])
def test_malformed_coordinator_address_is_refused(address, monkeypatch):
  from jaxcomp import distributed
  monkeypatch.setenv(distributed.ENV_COORDINATOR, address)
  with pytest.raises(ValueError, match="host:port"):
    distributed.initialize_from_env(num_processes=2, process_id=0)


def test_launcher_missing_program_fails_before_starting_any_process():
  with pytest.raises(FileNotFoundError, match=r"command\[0\].*no-such-prog"):
    launch.launch(["no-such-prog-jaxcomp"], 2)
  r = subprocess.run([sys.executable, "-m", "jaxcomp.cli", "launch", "-n", "2", "--",
                      "no-such-prog-jaxcomp"], capture_output=True, text=True,
                     timeout=60, env=_clean_env())
  assert r.returncode == 2 and "no-such-prog-jaxcomp" in r.stderr, r.stderr
  assert "[p0]" not in r.stdout, r.stdout


def test_launcher_forks_no_python_code_beside_jax_threads():
  """Launching from a process whose JAX runtime has started threads: no
  Python code may run between fork and exec (JAX warns when it does)."""
  jax.devices()  # starts the runtime's threads
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    res = launch.launch([sys.executable, "-c", "print('hi')"], 2,
                        stdout=_Out(), env=_clean_env(), timeout=60)
  assert res.returncode == 0, res
  assert not [w for w in caught if "fork" in str(w.message)], caught


WORKER = textwrap.dedent("""
    import jax, numpy as np
    from jax import lax
    from jax.experimental import multihost_utils
    from jax.sharding import PartitionSpec as P
    from jaxcomp import distributed

    assert distributed.initialize_from_env(heartbeat_timeout_seconds=10)
    mesh = distributed.global_mesh(("hosts", "devices"))
    axes = ("hosts", "devices")
    n = mesh.devices.size
    # Integer-valued floats: any summation order gives the exact result.
    x = np.arange(n * n * 3, dtype=np.float32).reshape(n, n * 3) * 3 - 7
    xs = distributed.global_array(x, mesh, P(axes))

    def body(v):
      v = v[0]
      s = lax.psum(v, axes)
      rs = lax.psum_scatter(v, axes, scatter_dimension=0, tiled=True)
      a2a = lax.all_to_all(v.reshape(n, 3), axes, 0, 0, tiled=True)
      ag = lax.all_gather(v, axes)
      return s[None], rs[None], a2a.reshape(-1)[None], ag[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes),
                              out_specs=(P(axes),) * 4))
    outs = [np.asarray(multihost_utils.process_allgather(
        o, tiled=True)) for o in f(xs)]
    total = x.sum(0)
    np.testing.assert_array_equal(outs[0], np.broadcast_to(total, (n, n * 3)))
    np.testing.assert_array_equal(outs[1].reshape(-1), total)  # jax#40830
    np.testing.assert_array_equal(
        outs[2], x.reshape(n, n, 3).transpose(1, 0, 2).reshape(n, n * 3))
    np.testing.assert_array_equal(outs[3], np.broadcast_to(x, (n, n, n * 3)))
    print("collectives exact", flush=True)

    tree = {"w": distributed.global_array(np.ones((3, 2), np.float32), mesh),
            "r": distributed.global_array(x, mesh, P(axes))}
    assert distributed.check_consistency(tree) == 1
    w = tree["w"]
    bump = 1.0 if jax.process_index() == 1 else 0.0
    shards = [jax.device_put(s.data + bump, s.device)
              for s in w.addressable_shards]
    tree["w"] = jax.make_array_from_single_device_arrays(w.shape, w.sharding,
                                                         shards)
    try:
      distributed.check_consistency(tree, name="state")
    except distributed.ConsistencyError as e:
      assert "state['w'] diverged across processes" in str(e), e
      assert "processes [0]" in str(e) and "processes [1]" in str(e), e
      print("divergence detected", flush=True)
    else:
      raise SystemExit("divergence not detected")
""")


def test_collectives_exact_and_divergence_detected_across_processes(tmp_path):
  worker = tmp_path / "worker.py"
  worker.write_text(WORKER)
  out = _Out()
  res = launch.launch([sys.executable, str(worker)], 2, devices_per_process=2,
                      env=_clean_env(), stdout=out, timeout=JOB_TIMEOUT)
  assert res.returncode == 0, out.text
  assert out.text.count("collectives exact") == 2, out.text
  assert out.text.count("divergence detected") == 2, out.text


def _wait_until(cond, seconds):
  """Polls ``cond()`` every 0.1 s until it is true or ``seconds`` have
  passed; returns its last value."""
  deadline = time.monotonic() + seconds
  while not (ok := cond()) and time.monotonic() < deadline:
    time.sleep(0.1)
  return ok


def _launch_sleepers(tmp_path, **popen_kw):
  """The launcher CLI running 2 processes that sleep; returns it and the
  children's pids once both have written them."""
  pids = tmp_path / "pids"
  pids.mkdir()
  child = ("import os, time\n"
           f"path = os.path.join({str(pids)!r}, "
           "os.environ['JAXCOMP_PROCESS_ID'])\n"
           "open(path + '.tmp', 'w').write(str(os.getpid()))\n"
           "os.replace(path + '.tmp', path)\n"  # readers never see half
           "time.sleep(600)\n")
  proc = subprocess.Popen(
      [sys.executable, "-m", "jaxcomp.cli", "launch", "-n", "2", "--", sys.executable,
       "-c", child], env=_clean_env(), **popen_kw)
  done = lambda: [f for f in pids.iterdir() if f.suffix != ".tmp"]
  _wait_until(lambda: len(done()) >= 2, seconds=60)
  return proc, [int(f.read_text()) for f in done()]


def test_launcher_interrupted_stops_its_children(tmp_path):
  proc, children = _launch_sleepers(tmp_path, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
  try:
    assert len(children) == 2
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGINT, err
  assert "interrupted by SIGINT" in err, err
  for pid in children:
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)


def _dead(pid):
  """Gone or a zombie: an orphan is reaped by whoever is PID 1, if at all."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
  except FileNotFoundError:
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="PR_SET_PDEATHSIG is Linux's")
def test_children_die_when_the_launcher_is_killed(tmp_path):
  proc, children = _launch_sleepers(tmp_path, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
  try:
    assert len(children) == 2
    proc.send_signal(signal.SIGKILL)  # no chance to clean up
    proc.wait(timeout=30)
    assert _wait_until(lambda: all(map(_dead, children)), seconds=30), children
  finally:
    proc.kill()
    for pid in children:
      if not _dead(pid):
        os.kill(pid, signal.SIGKILL)


_AGREE = r"""
import os, sys
from jaxcomp import distributed
distributed.initialize_from_env()
import jax, jax.numpy as jnp, optax
import jaxcomp
pid = int(os.environ["JAXCOMP_PROCESS_ID"])
case = sys.argv[1]
ratio = 0.2 if case == "ratio" and pid == 1 else 0.1
hidden = 16 if case == "hidden" and pid == 1 else 8
mesh = distributed.global_mesh(("hosts", "devices"))
params = distributed.global_array({"w": jnp.zeros((6, hidden))}, mesh)
tx = optax.chain(jaxcomp.compressed_mean("topk", ("hosts", "devices"),
                                         ratio=ratio), optax.sgd(0.1))
try:
  jaxcomp.placement.init_sharded(tx, params, mesh, ("hosts", "devices"))
except distributed.AgreementError as e:
  # One write: gloo's C++ log lines share the pipe, and print's separate
  # writes of "AGREEMENT", " " and the message were seen split by one.
  sys.stdout.write(f"AGREEMENT {e}\n")
  sys.stdout.flush()
  sys.exit(3)
print("agreed", flush=True)
"""


@pytest.mark.parametrize("case,names", [
    ("same", None),
    ("ratio", r"compressor.*'ratio': 0\.[12]"),
    ("hidden", r"params\['w'\] is float32\[6, (8|16)\]"),
])
def test_processes_started_differently_fail_at_init_naming_it(case, names):
  """Processes started with another hyperparameter or model shape fail in
  init_sharded, on every process, within seconds and naming the difference,
  instead of aborting a collective or diverging."""
  import re
  out = _Out()
  res = launch.launch([sys.executable, "-c", _AGREE, case], 2,
                      devices_per_process=2, env=_clean_env(), stdout=out,
                      timeout=120)
  if names is None:
    assert res.returncode == 0 and out.text.count("agreed") == 2, out.text
    return
  lines = [l for l in out.text.splitlines() if "AGREEMENT" in l]
  assert len(lines) == 2, out.text  # both processes say it
  assert all(re.search(names, l) for l in lines), lines
  assert set(res.returncodes) == {3} and res.seconds < 60, res


def test_resume_past_the_requested_steps_is_refused(tmp_path):
  """A checkpoint at step 4 resumed with --steps 2 is refused (it used to
  print 'done step 2' while holding step 4's parameters)."""
  base = [a for a in BASE]
  i = base.index("--steps")
  ckpt = str(tmp_path / "ckpt")
  res, log = _job([*base[:i], "--steps", "4", *base[i + 2:],
                   "--checkpoint-dir", ckpt, "--save-every", "4"])
  assert res.returncode == 0, log
  res, log = _job([*base[:i], "--steps", "2", *base[i + 2:],
                   "--checkpoint-dir", ckpt, "--resume"])
  assert set(res.returncodes) == {2}, (res, log)
  assert "at step 4, past --steps 2" in log, log


def test_sigterm_to_the_launcher_checkpoints_and_resume_is_bit_exact(
    uninterrupted, tmp_path):
  """A scheduler's preemption: SIGTERM to the launcher is forwarded, every
  process stops at the same step, saves a checkpoint and exits 0; the
  launcher exits 0; resuming from that checkpoint ends bit-exactly where the
  uninterrupted run does."""
  import threading
  ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
  args = [*BASE, "--checkpoint-dir", ckpt, "--output", out]
  proc = subprocess.Popen(
      [sys.executable, "-m", "jaxcomp.cli", "launch", "-n", "2",
       "--devices-per-process", "2", "--preemption-grace", "60", "--",
       sys.executable, SCRIPT, *args, "--step-delay", "1.0"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env=_clean_env())
  lines = []
  reader = threading.Thread(target=lambda: lines.extend(proc.stdout),
                            daemon=True)
  reader.start()
  try:
    _wait_until(lambda: sum("mesh" in l for l in lines) == 2, 120)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=90)
  finally:
    proc.kill()
  reader.join(timeout=10)
  log = "".join(lines)
  assert proc.returncode == 0, log
  stops = re.findall(r"preempted before step (\d+); saved a checkpoint", log)
  assert len(stops) == 2 and stops[0] == stops[1], log
  step = int(stops[0])
  assert 0 < step < STEPS and os.listdir(ckpt) == [str(step)], log
  res, log2 = _job([*args, "--resume"])
  assert res.returncode == 0 and f"resumed from step {step}" in log2, log2
  _assert_bitwise_equal(_params(out, 0), _params(uninterrupted[0], 0))
  _assert_bitwise_equal(_params(out, 1), _params(uninterrupted[0], 1))
