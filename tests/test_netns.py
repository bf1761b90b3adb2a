"""benchmarks/netns.py never leaks: workers die with their driver, SIGTERM
removes the namespaces, a SIGKILLed driver's leftovers are removed on the
next start, and two clusters keep to their own names (root, ip and tc
needed; skipped otherwise)."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)
import netns  # noqa: E402  (benchmarks/netns.py)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
    reason="network namespaces need root, ip and tc")

_DRIVER = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
import netns
with netns.RateLimitedCluster(2) as c:
  p = c.popen(0, ["sleep", "300"])
  print(c.prefix, p.pid, flush=True)
  time.sleep(300)
"""


def _namespaces():
  out = subprocess.run(["ip", "netns", "list"], capture_output=True,
                       text=True).stdout
  return {line.split()[0] for line in out.splitlines() if line.split()}


def _start_driver():
  d = subprocess.Popen([sys.executable, "-c", _DRIVER, BENCH],
                       stdout=subprocess.PIPE, text=True, env={
                           **os.environ, "PYTHONPATH": ROOT})
  prefix, _ = d.stdout.readline().split()
  deadline = time.time() + 30
  while time.time() < deadline:  # the worker (sleep) runs inside w0
    pids = subprocess.run(["ip", "netns", "pids", f"{prefix}w0"],
                          capture_output=True, text=True).stdout.split()
    if pids:
      return d, prefix, [int(p) for p in pids]
    time.sleep(0.1)
  raise AssertionError("the worker did not start")


def _gone(pid, seconds=10):
  deadline = time.time() + seconds
  while time.time() < deadline:
    try:
      with open(f"/proc/{pid}/stat") as f:
        if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
          return True
    except FileNotFoundError:
      return True
    time.sleep(0.1)
  return False


def test_sigterm_removes_the_namespaces_and_their_workers():
  d, prefix, workers = _start_driver()
  assert {f"{prefix}hub", f"{prefix}w0", f"{prefix}w1"} <= _namespaces()
  d.send_signal(signal.SIGTERM)
  assert d.wait(timeout=30) == 128 + signal.SIGTERM
  assert not any(n.startswith(prefix) for n in _namespaces())
  assert not os.path.exists(f"/etc/netns/{prefix}w0")
  assert all(_gone(w) for w in workers)


def test_sigkilled_driver_leaves_nothing_after_the_next_start():
  d, prefix, workers = _start_driver()
  d.kill()
  d.wait(timeout=30)
  assert all(_gone(w) for w in workers)  # they died with the driver
  assert f"{prefix}hub" in _namespaces()  # left by the SIGKILL ...
  netns.RateLimitedCluster.cleanup_orphans()  # ... removed on the next start
  assert not any(n.startswith(prefix) for n in _namespaces())


def test_two_clusters_keep_to_their_own_names():
  a, pa, _ = _start_driver()
  b, pb, _ = _start_driver()
  try:
    assert pa != pb
    netns.RateLimitedCluster.cleanup_orphans()  # both drivers alive
    names = _namespaces()
    assert f"{pa}hub" in names and f"{pb}hub" in names
  finally:
    for d in (a, b):
      d.send_signal(signal.SIGTERM)
      d.wait(timeout=30)
