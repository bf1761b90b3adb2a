"""Rate-limited links between processes, for benchmarks (Linux, root).

Each worker runs in its own network namespace, joined to a bridge in a hub
namespace by a veth pair; ``tc qdisc ... tbf`` limits both ends of every veth,
so every worker sends and receives at the given rate. netem is not used (and
not available in every kernel), so no latency is added.

JAX's gloo collectives bind to the address that the machine's hostname
resolves to. JAX 0.10.2 has no public option for that address (jaxlib's
``make_gloo_tcp_collectives`` takes ``hostname=`` but ``jax._src.xla_bridge``
does not pass it), so :func:`gloo_bind_workaround` uses the supported
mechanism of ``ip netns exec``: it bind-mounts ``/etc/netns/NAME/hosts`` over
``/etc/hosts`` inside the namespace, and that file maps the hostname to the
namespace's own address.

Everything created is removed on exit from :class:`RateLimitedCluster`, also
when a run fails or the process gets SIGTERM/SIGINT (the benchmark turns those
into exceptions), and leftovers of an earlier crashed run with the same prefix
are removed on entry.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from typing import Sequence

__all__ = ["NetnsUnavailable", "check_prerequisites", "gloo_bind_workaround",
           "RateLimitedCluster", "Namespace"]


class NetnsUnavailable(RuntimeError):
  """This machine cannot build rate-limited namespaces (no root, ip or tc)."""


def check_prerequisites() -> None:
  """Raises :class:`NetnsUnavailable` saying what is missing."""
  if os.geteuid() != 0:
    raise NetnsUnavailable(
        "needs root to create network namespaces and tc qdiscs "
        "(run as root, e.g. `sudo python benchmarks/validate_perfmodel.py`)")
  for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2")):
    if shutil.which(tool) is None:
      raise NetnsUnavailable(f"`{tool}` not found on PATH; install {pkg} "
                             "(apt-get install iproute2)")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
  r = subprocess.run(argv, capture_output=True, text=True)
  if check and r.returncode:
    raise RuntimeError(f"`{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip()}")
  return r


def gloo_bind_workaround(namespace: str, address: str) -> str:
  """Makes the hostname resolve to ``address`` inside ``namespace``; returns the file.

  The one workaround for gloo's bind address (see the module docstring).
  """
  d = os.path.join("/etc/netns", namespace)
  os.makedirs(d, exist_ok=True)
  path = os.path.join(d, "hosts")
  with open(path, "w") as f:
    f.write(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")
  return path


@dataclasses.dataclass(frozen=True)
class Namespace:
  name: str  # network namespace
  address: str  # IPv4 address of its veth
  veth: str  # its end of the veth pair (inside the namespace)
  peer: str  # the bridge end (inside the hub namespace)


class RateLimitedCluster:
  """``n`` namespaces on one bridge, every link limited by ``tc tbf``.

  Example::

      with RateLimitedCluster(2) as cluster:
        cluster.set_rate("1gbit")
        procs = [cluster.popen(i, ["python", "worker.py"]) for i in range(2)]
        ...

  Args:
    n: number of worker namespaces (>= 1).
    prefix: names of everything created start with it (also used to remove
      leftovers of a crashed run).
    subnet: first three octets of the private /24 to use.
  """

  def __init__(self, n: int, *, prefix: str = "jcmp", subnet: str = "10.231.7"):
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if not re.fullmatch(r"[a-z][a-z0-9]{0,5}", prefix):
      raise ValueError(f"prefix must be 1-6 lowercase letters/digits, got {prefix!r}")
    self.n, self.prefix, self.subnet = n, prefix, subnet
    self.hub = f"{prefix}hub"
    self.bridge = f"{prefix}br"
    self.namespaces = [Namespace(f"{prefix}w{i}", f"{subnet}.{i + 1}", f"{prefix}v{i}",
                                 f"{prefix}p{i}") for i in range(n)]
    self._procs: list[subprocess.Popen] = []
    self.rate: str | None = None

  # -- setup / teardown --

  def __enter__(self) -> "RateLimitedCluster":
    check_prerequisites()
    self.cleanup_stale(self.prefix)
    try:
      self._create()
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _create(self) -> None:
    _run("ip", "netns", "add", self.hub)
    _run("ip", "-n", self.hub, "link", "add", self.bridge, "type", "bridge")
    _run("ip", "-n", self.hub, "link", "set", self.bridge, "up")
    for ns in self.namespaces:
      _run("ip", "netns", "add", ns.name)
      _run("ip", "link", "add", ns.veth, "type", "veth", "peer", "name", ns.peer)
      _run("ip", "link", "set", ns.veth, "netns", ns.name)
      _run("ip", "link", "set", ns.peer, "netns", self.hub)
      _run("ip", "-n", self.hub, "link", "set", ns.peer, "master", self.bridge)
      _run("ip", "-n", self.hub, "link", "set", ns.peer, "up")
      _run("ip", "-n", ns.name, "addr", "add", f"{ns.address}/24", "dev", ns.veth)
      _run("ip", "-n", ns.name, "link", "set", ns.veth, "up")
      _run("ip", "-n", ns.name, "link", "set", "lo", "up")
      gloo_bind_workaround(ns.name, ns.address)

  def set_rate(self, rate: str | None, *, burst: str | None = None) -> None:
    """Limits every worker's link to ``rate`` (tc syntax, e.g. "1gbit") both ways.

    ``None`` removes the limit. ``burst`` defaults to about 1 ms at ``rate``
    (at least 64 KiB).
    """
    for ns in self.namespaces:
      for where, dev in ((ns.name, ns.veth), (self.hub, ns.peer)):
        _run("ip", "netns", "exec", where, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        if rate is not None:
          _run("ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev", dev, "root",
               "tbf", "rate", rate, "burst", burst or _default_burst(rate), "latency", "50ms")
    self.rate = rate

  def popen(self, i: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
    """Starts ``argv`` in namespace ``i`` in its own process group (tracked)."""
    p = subprocess.Popen(["ip", "netns", "exec", self.namespaces[i].name, *argv],
                         start_new_session=True, **kwargs)
    self._procs.append(p)
    return p

  def kill_all(self) -> None:
    """Kills the process groups of every process this cluster started."""
    for p in self._procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
    for p in self._procs:
      try:
        p.wait(timeout=10)
      except subprocess.TimeoutExpired:
        pass
    self._procs.clear()

  def close(self) -> None:
    self.kill_all()
    for ns in self.namespaces:
      _run("ip", "netns", "del", ns.name, check=False)
      shutil.rmtree(os.path.join("/etc/netns", ns.name), ignore_errors=True)
    _run("ip", "netns", "del", self.hub, check=False)

  @staticmethod
  def cleanup_stale(prefix: str) -> list[str]:
    """Deletes namespaces named ``{prefix}hub`` / ``{prefix}w<i>`` left by a crash."""
    r = _run("ip", "netns", "list", check=False)
    gone = []
    for line in r.stdout.splitlines():
      name = line.split()[0] if line.split() else ""
      if re.fullmatch(rf"{re.escape(prefix)}(hub|w\d+)", name):
        _run("ip", "netns", "del", name, check=False)
        shutil.rmtree(os.path.join("/etc/netns", name), ignore_errors=True)
        gone.append(name)
    if gone:
      time.sleep(0.2)
    return gone


def _default_burst(rate: str) -> str:
  m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)?bit", rate.lower())
  if not m:
    return "256kb"
  bits = float(m.group(1)) * {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
  return f"{max(64, int(bits / 8 / 1000 / 1024))}kb"  # ~1 ms of traffic
