"""Elastic DiLoCo islands on torchft (jaxcomp.elastic): islands as separate
JAX jobs, one SIGKILLed mid-interval, restarted, and a replacement after
every island stopped. Skipped without the ``elastic`` extra.

Three islands of two JAX processes each (``jax.distributed`` over gloo
inside an island, exact data parallelism), once: each island in its own
network namespace behind a 100 Mbit/s ``tc tbf`` link
(``benchmarks/netns.py``; root, ip and tc needed), the Lighthouse in a
fourth, or on localhost where namespaces cannot be made or
``JAXCOMP_TEST_NETNS=0``. ``examples/elastic/island.py`` is the island
program; each process writes one JSON line per event, which these tests
read.
"""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import shutil

import numpy as np
import pytest

pytest.importorskip("torchft", reason="needs the elastic extra: pip install "
                    "'jaxcomp[elastic]' (torch and torchft)")

import jax  # noqa: E402

from jaxcomp import compressors  # noqa: E402
from jaxcomp import elastic  # noqa: E402
from jaxcomp.elastic import _exchange  # noqa: E402
from jaxcomp.elastic import _outer  # noqa: E402
from jaxcomp import launch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ISLAND = os.path.join(ROOT, "examples", "elastic", "island.py")
# island -> namespace (0: Lighthouse)
NAMESPACE = {"a": 1, "b": 2, "c": 3, "d": 1, "x": 1}
# The faulted run goes once: in network namespaces where it can (root, ip
# and tc), else on localhost; JAXCOMP_TEST_NETNS=0 keeps it on localhost.
NETNS_OK = (os.geteuid() == 0 and shutil.which("ip") is not None
            and shutil.which("tc") is not None
            and os.environ.get("JAXCOMP_TEST_NETNS", "1") != "0")
PROCS = 2  # JAX processes per island
HEARTBEAT_S = 2.0  # the Lighthouse's heartbeat timeout
# An interval (6 steps x 0.05 s), the failed exchange's own detection, the
# quorum and the sync, on a busy 2-core machine.
MARGIN_S = 8.0


def _events(path):
  out = []
  if not os.path.exists(path):
    return out
  with open(path) as f:
    for line in f:
      if line.endswith("\n"):
        out.append(json.loads(line))
  return out


class _Islands:
  """The island processes of one run and their logs."""

  def __init__(self, tmp, cluster=None):
    self.tmp, self.cluster = str(tmp), cluster
    self.ckpt = os.path.join(self.tmp, "ckpt")
    self.stop = os.path.join(self.tmp, "stop")
    self.procs = {}
    self.servers = []
    self.lighthouse = None

  def env(self, **more):
    return {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=1", **more}

  def popen(self, namespace, cmd, out, env):
    if self.cluster is None:
      return subprocess.Popen(cmd, env=env, stdout=out,
                              stderr=subprocess.STDOUT, cwd=ROOT)
    return self.cluster.popen(namespace, cmd, env=env, stdout=out,
                              stderr=subprocess.STDOUT, cwd=ROOT)

  def start_lighthouse(self, min_replicas):
    """A Lighthouse (in-process on localhost; in namespace 0 with a
    cluster); sets and returns its address."""
    hb = str(int(HEARTBEAT_S * 1000))
    if self.cluster is None:
      server = elastic.lighthouse("[::]:0", min_replicas=min_replicas,
                                  join_timeout_ms=5000,
                                  heartbeat_timeout_ms=int(hb))
      self.servers.append(server)
      self.lighthouse = server.address()
      return self.lighthouse
    port = 29510 + len(self.servers)
    path = os.path.join(self.tmp, f"lighthouse{port}.out")
    p = self.popen(0, [sys.executable, "-m", "jaxcomp.cli", "lighthouse",
                       "--bind", f"0.0.0.0:{port}", "--min-replicas",
                       str(min_replicas), "--join-timeout-ms", "5000",
                       "--heartbeat-timeout-ms", hb], open(path, "w"),
                   self.env())
    self.servers.append(p)
    self.wait_for("the Lighthouse", lambda: os.path.exists(path) and "http"
                  in open(path).read(), timeout=60)
    self.lighthouse = f"http://{self.cluster.namespaces[0].address}:{port}"
    return self.lighthouse

  def stop_lighthouses(self):
    for server in self.servers:
      if isinstance(server, subprocess.Popen):
        server.kill()
        server.wait()
      else:
        server.shutdown()
    self.servers.clear()

  def start(self, name, tag=None, *extra, procs=PROCS):
    """Starts island ``name`` (``procs`` JAX processes); its logs and
    outputs are ``<tag>.p<process>.*``."""
    tag = tag or name
    port = launch.free_port()
    for r in range(procs):
      env = self.env()
      if procs > 1:
        env.update(JAXCOMP_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   JAXCOMP_NUM_PROCESSES=str(procs),
                   JAXCOMP_PROCESS_ID=str(r))
      cmd = [sys.executable, ISLAND, "--island", name,
             "--lighthouse", self.lighthouse, "--sync-every", "6",
             "--step-delay", "0.05", "--dim", "32", "--timeout", "5",
             "--quorum-timeout", "60", "--checkpoint-dir", self.ckpt,
             "--log", os.path.join(self.tmp, f"{tag}.p{{process}}.jsonl"),
             "--stop-file", self.stop, "--outer-steps", "500",
             "--output", os.path.join(self.tmp, f"{tag}.p{{process}}.npz"),
             *extra]
      out = open(os.path.join(self.tmp, f"{tag}.p{r}.out"), "w")
      self.procs[f"{tag}.p{r}"] = self.popen(NAMESPACE[name], cmd, out, env)
    return [self.procs[f"{tag}.p{r}"] for r in range(procs)]

  def log(self, tag, process=0):
    return os.path.join(self.tmp, f"{tag}.p{process}.jsonl")

  def of(self, tags):
    """The process keys of islands ``tags``."""
    return [k for k in self.procs if k.split(".")[0] in tags]

  def output(self, key):
    if "." not in key:
      key += ".p0"
    with open(os.path.join(self.tmp, f"{key}.out")) as f:
      return f.read()[-3000:]

  def wait_for(self, what, pred, timeout=60.0, alive=()):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
      got = pred()
      if got:
        return got
      for key in self.of(alive):
        if self.procs[key].poll() is not None:
          pytest.fail(f"island {key} exited ({self.procs[key].returncode}) "
                      f"while waiting for {what}:\n{self.output(key)}")
      time.sleep(0.05)
    pytest.fail(f"timed out after {timeout} s waiting for {what}; logs: "
                + "; ".join(f"{t}: {self.output(t)[-600:]}" for t in self.procs))

  def kill_all(self):
    for p in self.procs.values():
      if p.poll() is None:
        p.kill()
        p.wait()


def _syncs(events):
  return [e for e in events if e["event"] == "sync"]


@pytest.fixture(scope="module", params=["localhost", "netns"])
def faulted_run(request, tmp_path_factory):
  """a, b, c train; c is SIGKILLed mid-interval, restarted as c2 once a and
  b committed without it; all stop two commits after c2's first."""
  tmp = tmp_path_factory.mktemp(f"elastic_{request.param}")
  if request.param == "netns":
    if not NETNS_OK:
      pytest.skip("network namespaces need root, ip and tc (and "
                  "JAXCOMP_TEST_NETNS not 0)")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import netns  # benchmarks/netns.py
    with netns.RateLimitedCluster(4) as cluster:
      cluster.set_rate("100mbit")
      yield from _faulted_run(_Islands(tmp, cluster))
  else:
    if NETNS_OK:
      pytest.skip("the run in network namespaces covers it")
    yield from _faulted_run(_Islands(tmp))


def _faulted_run(run):
  t_start = time.monotonic()
  try:
    run.start_lighthouse(min_replicas=2)
    go = os.path.join(run.tmp, "go")
    for name in "abc":
      run.start(name, None, "--go-file", go)
    run.wait_for("three ready islands", lambda: all(
        any(e["event"] == "ready" for e in _events(run.log(n, r)))
        for n in "abc" for r in range(PROCS)), timeout=180, alive="abc")
    open(go, "w").close()
    mid = run.wait_for("c in the middle of its third interval", lambda: [
        e for e in _events(run.log("c"))
        if e["event"] == "mid" and e["step"] >= 2], alive="abc")[0]
    for key in run.of("c"):  # the whole island
      run.procs[key].send_signal(signal.SIGKILL)
    t_kill = time.time()
    for key in run.of("c"):
      run.procs[key].wait()
    run.wait_for("a and b to commit with two islands", lambda: all(
        any(e["committed"] and e["islands"] == 2 and e["t"] > t_kill
            for e in _syncs(_events(run.log(n)))) for n in "ab"),
        alive="ab")
    t_restart = time.time()
    run.start("c", "c2")
    last = run.wait_for("c2 to commit with three islands", lambda: [
        e for e in _syncs(_events(run.log("c2")))
        if e["committed"] and e["islands"] == 3], timeout=90,
        alive=("a", "b", "c2"))[0]
    stop_at = last["step"] + 2
    with open(run.stop + ".tmp", "w") as f:
      f.write(str(stop_at))
    os.replace(run.stop + ".tmp", run.stop)
    for key in run.of(("a", "b", "c2")):
      try:
        run.procs[key].wait(timeout=60)
      except subprocess.TimeoutExpired:
        pytest.fail(f"island {key} did not stop:\n{run.output(key)}")
      assert run.procs[key].returncode == 0, run.output(key)
  finally:
    run.kill_all()
    run.stop_lighthouses()
  yield dict(run=run, t_kill=t_kill, t_restart=t_restart, mid=mid,
             stop_at=stop_at, seconds=time.monotonic() - t_start,
             events={t: _events(run.log(t)) for t in ("a", "b", "c", "c2")},
             process_events={(t, r): _events(run.log(t, r))
                             for t in ("a", "b", "c", "c2")
                             for r in range(PROCS)})


def test_survivors_discard_the_interrupted_interval(faulted_run):
  t_kill = faulted_run["t_kill"]
  for tag in "ab":
    ev = faulted_run["events"][tag]
    syncs = _syncs(ev)
    failed = [e for e in syncs if not e["committed"] and e["t"] > t_kill]
    assert failed, f"{tag} committed every interval after the kill"
    first = failed[0]
    assert first["islands"] == 3, first  # the interval c was killed in
    assert first["error"], first  # the exchange itself failed
    # Nothing moved: the anchor, the residual and the step are those the
    # interval began with.
    begin = [e for e in ev if e["event"] == "begin" and e["t"] < first["t"]][-1]
    assert (first["anchor"], first["residual"], first["step"]) == (
        begin["anchor"], begin["residual"], begin["step"])
    # The next commit: two islands, within the heartbeat timeout + margin.
    nxt = [e for e in syncs if e["committed"] and e["t"] > first["t"]][0]
    assert nxt["islands"] == 2, nxt
    assert nxt["step"] == first["step"] + 1
    assert nxt["t"] - t_kill < HEARTBEAT_S + MARGIN_S, (nxt["t"] - t_kill)


def test_restarted_island_heals_and_commits_with_three(faulted_run):
  ev = faulted_run["events"]
  c2 = ev["c2"]
  ready = [e for e in c2 if e["event"] == "ready"][0]
  # c's own checkpoint or a peer's: not step 0, not beyond the survivors.
  assert ready["restored"] is not None and ready["restored"] >= 2, ready
  begins = [e for e in c2 if e["event"] == "begin"]
  assert begins[0]["healed"], begins[0]  # behind the survivors: healed
  # The anchor (32 x 4 + 4 float32) and Nesterov's momentum (the same).
  assert begins[0]["heal_bytes"] == 2 * (32 * 4 + 4) * 4, begins[0]
  assert 0 < begins[0]["heal_seconds"] < 30
  assert begins[0]["step"] > ready["restored"]
  # Its healed anchor is the survivors' anchor at that step.
  a_at = {e["step"]: e["anchor"] for e in ev["a"] if e["event"] == "begin"}
  assert begins[0]["anchor"] == a_at[begins[0]["step"]]
  first = _syncs(c2)[0]
  assert first["committed"] and first["islands"] == 3, first


def test_steps_monotonic_and_anchors_bitwise_equal(faulted_run):
  ev, run = faulted_run["events"], faulted_run["run"]
  for tag in ("a", "b", "c", "c2"):
    prev = None
    for e in _syncs(ev[tag]):
      if prev is not None:
        assert e["step"] == prev + (1 if e["committed"] else 0), (tag, e)
      prev = e["step"]
  stop_at = faulted_run["stop_at"]
  finals = {}
  for tag in ("a", "b", "c2"):
    for r in range(PROCS):
      done = [e for e in faulted_run["process_events"][tag, r]
              if e["event"] == "done"][0]
      assert done["step"] == stop_at
      with np.load(os.path.join(run.tmp, f"{tag}.p{r}.npz")) as z:
        finals[tag, r] = {k: z[k] for k in z.files}
  assert len(finals) == 3 * PROCS
  for key, final in finals.items():
    assert final.keys() == finals["a", 0].keys()
    for k, v in finals["a", 0].items():
      assert v.tobytes() == final[k].tobytes(), (key, k)
  # The same training happened everywhere: every commit of a step carries
  # the same anchor on every process of every island, and the processes of
  # an island commit (or not) together.
  by_step = {}
  for (tag, _), pev in faulted_run["process_events"].items():
    assert [(e["step"], e["committed"]) for e in _syncs(pev)] == [
        (e["step"], e["committed"]) for e in _syncs(ev[tag])][:len(_syncs(pev))]
    for e in _syncs(pev):
      if e["committed"]:
        by_step.setdefault(e["step"], set()).add(e["anchor"])
  assert all(len(v) == 1 for v in by_step.values()), by_step
  # Each process sent its share (66 of the 132 elements) and the island
  # gathered the averaged shares.
  for pev in faulted_run["process_events"].values():
    for e in _syncs(pev):
      if e["committed"]:
        assert e["bytes"] == _half_payload(66) and e["gather_bytes"] > 0, e
  # Training made progress: the loss fell.
  losses = [e["loss"] for e in _syncs(ev["a"])]
  assert losses[-1] < 0.5 * losses[0], losses


def test_checkpoints_hold_committed_anchors_only(faulted_run):
  """Every Orbax checkpoint is a commit's anchor (its digest is the one
  every island logged for that step); no interrupted exchange wrote one."""
  ev, run = faulted_run["events"], faulted_run["run"]
  committed = {}
  for tag in ("a", "b", "c", "c2"):
    for e in _syncs(ev[tag]):
      if e["committed"]:
        committed[e["step"]] = e["anchor"]
  metas = glob.glob(os.path.join(run.ckpt, "*", "*", "meta", "metadata"))
  assert len(metas) >= 3, metas
  for path in metas:
    with open(path) as f:
      meta = json.load(f)
    assert committed.get(meta["step"]) == meta["digest"], (path, meta["step"])


def test_replacement_after_all_stopped_restores_from_checkpoint(faulted_run):
  run, stop_at = faulted_run["run"], faulted_run["stop_at"]
  final = [e for e in faulted_run["events"]["a"] if e["event"] == "done"][0]
  os.remove(run.stop)
  try:
    run.start_lighthouse(min_replicas=1)
    for p in run.start("d", None, "--outer-steps", str(stop_at + 1)):
      p.wait(timeout=90)
      assert p.returncode == 0, run.output("d")
  finally:
    run.kill_all()
    run.stop_lighthouses()
  ev = _events(run.log("d"))
  ready = [e for e in ev if e["event"] == "ready"][0]
  assert ready["restored"] == stop_at and ready["step"] == stop_at
  assert ready["anchor"] == final["anchor"]  # not step 0's parameters
  begin = [e for e in ev if e["event"] == "begin"][0]
  assert not begin["healed"] and begin["step"] == stop_at
  sync = _syncs(ev)[0]
  assert sync["committed"] and sync["islands"] == 1
  assert sync["step"] == stop_at + 1


def test_four_islands_a_refused_joiner_and_a_kill(tmp_path):
  """Four islands of one process start together (``--wait-for 4``: the
  first commit has all four). A joiner with another model is refused at its
  heal and no healthy island loses an interval to it. Then c is SIGKILLed
  mid-interval: a, which is not c's neighbour in a ring, and b and d each
  commit with three islands within the heartbeat timeout + 3 s."""
  run = _Islands(tmp_path)
  names = "abcd"
  syncs = lambda tag: _syncs(_events(run.log(tag)))
  go = os.path.join(run.tmp, "go_x")
  try:
    run.start_lighthouse(min_replicas=2)
    for name in names:
      run.start(name, None, "--wait-for", "4", procs=1)
    # The joiner starts beside them (its imports overlap theirs) and asks
    # for a quorum once they committed.
    (joiner,) = run.start("x", None, "--dim", "16", "--checkpoint-dir",
                          str(tmp_path / "x_ckpt"), "--go-file", go, procs=1)
    run.wait_for("the four islands' first commits", lambda: all(
        any(e["committed"] for e in syncs(n)) for n in names), timeout=180,
        alive=names)
    t_join = time.time()
    open(go, "w").close()
    run.wait_for("the joiner to be refused", lambda: joiner.poll() is not None,
                 timeout=90, alive=names)
    assert joiner.returncode != 0 and "ElasticConfigError" in run.output("x")
    t_refused = time.time()
    step = max(e["step"] for e in syncs("a"))
    mid = run.wait_for("c in the middle of an interval", lambda: [
        e for e in _events(run.log("c"))
        if e["event"] == "mid" and e["step"] >= step + 1], alive=names)[0]
    run.procs["c.p0"].send_signal(signal.SIGKILL)
    t_kill = time.time()
    run.procs["c.p0"].wait()
    survivors = "abd"
    run.wait_for("a, b and d to commit after the kill", lambda: all(
        any(e["committed"] and e["t"] > t_kill for e in syncs(n))
        for n in survivors), timeout=30, alive=survivors)
    with open(run.stop + ".tmp", "w") as f:
      f.write(str(mid["step"] + 2))
    os.replace(run.stop + ".tmp", run.stop)
    for key in run.of(survivors):
      run.procs[key].wait(timeout=60)
      assert run.procs[key].returncode == 0, run.output(key)
  finally:
    run.kill_all()
    run.stop_lighthouses()
  for n in names:
    first = [e for e in syncs(n) if e["committed"]][0]
    assert first["islands"] == 4, first  # the clean start
  for n in survivors:
    during = [e for e in syncs(n) if t_join < e["t"] < t_kill]
    # The joiner cost no interval: every sync from its start to the kill
    # committed, with the four healthy islands.
    assert all(e["committed"] and e["islands"] == 4 for e in during), during
    assert any(e["t"] > t_refused for e in during), during
    nxt = [e for e in syncs(n) if e["committed"] and e["t"] > t_kill][0]
    assert nxt["islands"] == 3, (n, nxt)
    assert nxt["t"] - t_kill < HEARTBEAT_S + 3, (n, nxt["t"] - t_kill)
  assert mid["step"] >= 1


def test_joiner_with_another_model_gets_a_clear_error(tmp_path):
  """A heal from a peer with another model, and a checkpoint of another
  model, raise ElasticConfigError naming what differs; nothing changes."""
  import jax.numpy as jnp

  server = elastic.lighthouse("[::]:0", min_replicas=1)
  try:
    mk = lambda name, d, **kw: elastic.ElasticDiLoCo(
        {"w": jnp.ones((d,), jnp.float32)}, island=name,
        lighthouse=server.address(), connect_timeout=10, **kw)
    a, b = mk("a", 4), mk("b", 5)
    before = elastic.digest(b.anchor)
    with pytest.raises(elastic.ElasticConfigError, match=r"params.*\[4\]"):
      b._load_state_dict(a._state_dict())
    assert elastic.digest(b.anchor) == before and not b.healed
    # Same model, another compressor: refused too.
    c = mk("c", 4, compressor="topk", compressor_kwargs={"ratio": 0.5})
    with pytest.raises(elastic.ElasticConfigError, match="compressor"):
      c._load_state_dict(a._state_dict())
    # The same configuration heals.
    a2 = mk("a2", 4)
    a2._load_state_dict(a._state_dict())
    assert a2.healed
    for isl in (a, b, c, a2):
      isl.close()
    # A checkpoint of a 4-element model refuses a 5-element island.
    ckpt = str(tmp_path / "ckpt")
    d = mk("d", 4, checkpoint_dir=ckpt)
    d._save(3)
    d.close()
    with pytest.raises(elastic.ElasticConfigError, match="checkpoint"):
      mk("e", 5, checkpoint_dir=ckpt)
    f = mk("f", 4, checkpoint_dir=ckpt)
    assert f.restored_step == 3 and f.step == 3
    f.close()
  finally:
    server.shutdown()


def _half_payload(elements):
  """int8_block's payload for an ``elements``-element share (bytes)."""
  return _outer.plan_buffer([np.zeros((elements,), np.float32)],
                            compressors.get("int8_block"),
                            jax.random.key(0)).payload_bytes


def test_islands_launcher(tmp_path):
  """``jaxcomp islands -n 2 -m 2 --bind 127.0.0.1:0 --advertise 127.0.0.1
  -- island --fsdp`` starts the Lighthouse there and two FSDP islands of
  two JAX processes, i0 and i1 (each process holding half the rows of
  every parameter); both commit together (the first commit with both:
  ``--wait-for`` defaults to all) and end with the same anchor. Each
  process passes the process group half the payload (its rows: 34 of the
  68 elements) and the island gathers nothing."""
  log = str(tmp_path / "{island}.p{process}.jsonl")
  out = subprocess.run(
      [sys.executable, "-m", "jaxcomp.cli", "islands", "-n", "2", "-m",
       "2", "--bind", "127.0.0.1:0", "--advertise", "127.0.0.1", "--",
       sys.executable, ISLAND, "--outer-steps", "3",
       "--sync-every", "4", "--dim", "16", "--fsdp", "--log", log],
      cwd=ROOT, capture_output=True, text=True, timeout=110,
      env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
  assert "[lighthouse] http://127.0.0.1:" in out.stdout
  done = {}
  for island in ("i0", "i1"):
    for r in range(2):
      ev = _events(str(tmp_path / f"{island}.p{r}.jsonl"))
      assert [e for e in ev if e["event"] == "sync"
              and e["committed"]][0]["islands"] == 2, ev
      done[island, r] = [e for e in ev if e["event"] == "done"][0]
      syncs = _syncs(ev)
      sent = np.diff([0] + [e["pg_bytes"] for e in syncs])
      # The handshake's header and the share's payload, nothing else.
      assert all(e["bytes"] == _half_payload(34) for e in syncs), syncs
      assert sent.tolist() == [_exchange.HEADER_BYTES + _half_payload(34)] * len(syncs)
      assert all(e["gather_bytes"] == 0 for e in syncs), syncs
  assert {d["step"] for d in done.values()} == {3}
  assert len({d["anchor"] for d in done.values()}) == 1
  # Process r of each island holds (and synced) the same rows.
  for r in range(2):
    per_step = [{e["step"]: e["anchor"] for e in _syncs(_events(
        str(tmp_path / f"{i}.p{r}.jsonl"))) if e["committed"]}
        for i in ("i0", "i1")]
    assert per_step[0] == per_step[1]


def test_launcher_options_and_names():
  """``--wait-for``, ``--bind`` and ``--advertise`` reach run_islands; the
  help names the islands; the advertised address keeps the bound port;
  ``wait_for`` below 1 is refused before anything starts."""
  import argparse
  from jaxcomp.elastic import launcher

  sub = argparse.ArgumentParser().add_subparsers()
  isl = launcher.add_islands_command(sub)
  assert "i0, i1, ..., i{N-1}" in isl.description
  args = isl.parse_args(["-n", "4", "--wait-for", "3", "--bind",
                         "127.0.0.1:0", "--advertise", "10.0.0.2", "--",
                         "prog"])
  assert (args.islands, args.wait_for, args.bind, args.advertise) == (
      4, 3, "127.0.0.1:0", "10.0.0.2")
  server = elastic.lighthouse("127.0.0.1:0")
  try:
    port = server.address().rsplit(":", 1)[1]
    assert launcher.advertised(server, "10.0.0.2") == f"http://10.0.0.2:{port}"
    assert launcher.advertised(server) == server.address()
  finally:
    server.shutdown()
  with pytest.raises(ValueError, match="wait_for"):
    elastic.ElasticDiLoCo({"w": np.ones((2,), np.float32)}, island="a",
                          lighthouse="http://127.0.0.1:1", wait_for=0)
  with pytest.raises(ValueError, match="wait_for"):
    launcher.run_islands(["prog"], 2, wait_for=0)


def test_quorum_below_the_minimum_raises_quorum_error(tmp_path):
  """An island alone where the Lighthouse wants two gets no quorum: after
  ``quorum_timeout`` it raises QuorumError, its anchor and step intact."""
  import jax.numpy as jnp

  server = elastic.lighthouse("[::]:0", min_replicas=2)
  try:
    isl = elastic.ElasticDiLoCo({"w": jnp.ones((4,), jnp.float32)},
                                island="alone", lighthouse=server.address(),
                                quorum_timeout=1.5, connect_timeout=10)
    before = elastic.digest(isl.anchor)
    t0 = time.monotonic()
    with pytest.raises(elastic.QuorumError, match="alone"):
      isl.begin()
    assert 1.0 < time.monotonic() - t0 < 30
    assert elastic.digest(isl.anchor) == before and isl.step == 0
    isl.close()
  finally:
    server.shutdown()


def test_an_exchange_that_does_not_commit_changes_nothing(tmp_path):
  """The exchange succeeded here but torchft says not to commit (another
  process of the island failed): the outer step computed is dropped; the
  anchor, outer state, residual and step stay, and no checkpoint is
  written. The next interval commits and changes all of them."""
  import jax
  import jax.numpy as jnp

  server = elastic.lighthouse("[::]:0", min_replicas=1)
  ckpt = str(tmp_path / "ckpt")
  try:
    isl = elastic.ElasticDiLoCo(
        {"w": jnp.zeros((300,), jnp.float32)}, island="solo",
        lighthouse=server.address(), compressor="topk",
        compressor_kwargs={"ratio": 0.1}, checkpoint_dir=ckpt,
        connect_timeout=10)
    local = {"w": jnp.linspace(-1.0, 1.0, 300, dtype=jnp.float32)}
    state = lambda: (elastic.digest(isl.anchor),
                     elastic.digest(isl.outer_state),
                     elastic.digest(isl.residual), isl.step)
    isl.begin()
    before = state()
    real = isl._exchange

    def exchange_then_fail(x):  # as when another process reports an error
      out = real(x)
      isl._manager.report_error(RuntimeError("another process failed"))
      return out

    isl._exchange = exchange_then_fail
    r = isl.sync(local)
    assert not r.committed and r.error is None and r.bytes_sent == 240
    assert state() == before
    assert not os.path.exists(os.path.join(ckpt, "solo", "1"))
    isl._exchange = real
    isl.begin()
    r = isl.sync(local)
    after = state()
    assert r.committed and r.step == 1
    assert all(a != b for a, b in zip(after[:3], before[:3]))
    # top-k with error feedback: 30 of 300 values sent, the rest kept.
    assert int(jnp.sum(isl.residual != 0)) == 270
    assert sorted(os.listdir(os.path.join(ckpt, "solo"))) == ["1"]
    assert jax.tree.leaves(r.params)[0].shape == (300,)
    isl.close()
  finally:
    server.shutdown()
