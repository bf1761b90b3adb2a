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

Nothing leaks. Everything created is removed on exit from
:class:`RateLimitedCluster`, also when a run fails or the driver gets SIGTERM
or SIGINT (the cluster turns SIGTERM into ``SystemExit`` while it is open);
the workers die with the driver (a parent-death signal, also when the driver
is SIGKILLed); and leftovers of a driver that was SIGKILLed (namespaces, their
``/etc/netns`` files and any process still inside them) are removed on the
next start. By default each cluster's names carry its driver's process id
(prefix ``j<pid>``, and a subnet derived from it), so two clusters never
remove each other's namespaces, and leftovers are recognised by their dead
owner.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

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


def _default_prefix() -> str:
  return f"j{os.getpid()}"


def _default_subnet() -> str:
  return f"10.231.{os.getpid() % 250 + 1}"


_OWNED = re.compile(r"j(\d+)(hub|w\d+)")  # names of the default prefixes


class RateLimitedCluster:
  """``n`` namespaces on one bridge, every link limited by ``tc tbf``.

  Example::

      with RateLimitedCluster(2) as cluster:
        cluster.set_rate("1gbit")
        procs = [cluster.popen(i, ["python", "worker.py"]) for i in range(2)]
        ...

  Args:
    n: number of worker namespaces (>= 1).
    prefix: names of everything created start with it; default ``j<pid>``
      of this driver (unique while it runs, and recognisable as stale once it
      is gone). An explicit prefix also removes leftovers with that prefix.
    subnet: first three octets of the private /24 to use; default derived
      from the driver's pid.
  """

  def __init__(self, n: int, *, prefix: str | None = None,
               subnet: str | None = None):
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(f"n must be an integer >= 1, got {n!r}")
    prefix = prefix or _default_prefix()
    subnet = subnet or _default_subnet()
    if not re.fullmatch(r"[a-z][a-z0-9]{0,8}", prefix):
      raise ValueError(f"prefix must be 1-9 lowercase letters/digits, got {prefix!r}")
    if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet):
      raise ValueError(f"subnet must be three octets like '10.231.7', got {subnet!r}")
    self.n, self.prefix, self.subnet = n, prefix, subnet
    self.hub = f"{prefix}hub"
    self.bridge = f"{prefix}br"
    self.namespaces = [Namespace(f"{prefix}w{i}", f"{subnet}.{i + 1}", f"{prefix}v{i}",
                                 f"{prefix}p{i}") for i in range(n)]
    self._procs: list[subprocess.Popen] = []
    self.rate: str | None = None

  # -- setup / teardown --

  def __enter__(self) -> RateLimitedCluster:
    check_prerequisites()
    self.cleanup_stale(self.prefix)
    self.cleanup_orphans()
    self._old_sigterm = None
    if threading.current_thread() is threading.main_thread():
      self._old_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
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
    """Starts ``argv`` in namespace ``i`` in its own process group (tracked),
    through a stub that sets a parent-death signal first: the worker dies
    with this driver, however the driver ends."""
    from jaxcomp import launch  # pylint: disable=g-import-not-at-top
    ip = shutil.which("ip") or "ip"
    stub = [sys.executable, "-I", "-S", "-c", launch.DIE_WITH_PARENT,
            str(os.getpid()), ip, "ip", "netns", "exec",
            self.namespaces[i].name, *argv]
    p = subprocess.Popen(stub, start_new_session=True, **kwargs)
    self._procs.append(p)
    return p

  def run_result(self, argv_for, *, cwd: str, timeout: float, rank: int = 0):
    """Starts ``argv_for(i, coordinator)`` in every namespace (the
    coordinator is namespace 0's address, port given by the caller inside
    ``argv_for``), waits for all of them, and returns the JSON object that
    process ``rank`` printed on its last ``RESULT {...}`` line.

    Raises:
      RuntimeError: a worker failed or printed no result (with both workers'
        stderr tails), or they did not finish within ``timeout`` seconds
        (then they are killed).
    """
    import json  # pylint: disable=g-import-not-at-top
    procs = [self.popen(i, argv_for(i, self.namespaces[0].address), cwd=cwd,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True) for i in range(len(self.namespaces))]
    try:
      outs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
      self.kill_all()
      raise RuntimeError(f"the workers did not finish in {timeout:.0f} s") from None
    lines = [ln for ln in outs[rank][0].splitlines() if ln.startswith("RESULT ")]
    if not lines or any(p.returncode for p in procs):
      tails = "\n".join(err[-3000:] for _, err in outs)
      raise RuntimeError(f"a worker failed:\n{tails}")
    return json.loads(lines[-1][len("RESULT "):])

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
    for name in [ns.name for ns in self.namespaces] + [self.hub]:
      _delete(name)
    if getattr(self, "_old_sigterm", None) is not None:
      signal.signal(signal.SIGTERM, self._old_sigterm)
      self._old_sigterm = None

  @staticmethod
  def cleanup_stale(prefix: str) -> list[str]:
    """Deletes namespaces named ``{prefix}hub`` / ``{prefix}w<i>`` left by a
    crash, with any process still inside them."""
    return _delete_matching(
        lambda name: re.fullmatch(rf"{re.escape(prefix)}(hub|w\d+)", name))

  @staticmethod
  def cleanup_orphans() -> list[str]:
    """Deletes the namespaces of default-prefixed clusters (``j<pid>...``)
    whose driver is gone (SIGKILLed before it could clean up), with any
    process still inside them."""
    def orphan(name):
      m = _OWNED.fullmatch(name)
      return m is not None and not _alive(int(m.group(1)))
    return _delete_matching(orphan)


def together(tag: str, call, runs: int) -> float:
  """In a worker: the median seconds of ``call()`` over ``runs`` calls, each
  started by every process at once (a barrier before it), after one untimed
  call and leaving out the first two timed ones."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  jax.block_until_ready(call())
  ts = []
  for i in range(runs + 2):
    multihost_utils.sync_global_devices(f"{tag}{i}")
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts[2:])


def allreduce_seconds(mesh, axis: str, n: int, runs: int) -> float:
  """In a worker: :func:`together`'s time of a float32 all-reduce of ``n``
  elements per device over ``axis`` of ``mesh`` (every device holding its
  own row, the rows sharded over all of the mesh's axes)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from jaxcomp import distributed  # pylint: disable=g-import-not-at-top
  spec = P(tuple(mesh.axis_names))
  rows = len(jax.local_devices())
  x = distributed.global_array(np.ones((rows, n), np.float32), mesh, spec,
                               process_local=True)
  f = jax.jit(jax.shard_map(lambda v: lax.psum(v, axis), mesh=mesh,
                            in_specs=spec, out_specs=spec))
  return together(f"ar{axis}{n}", lambda: f(x), runs)


def fit_link(measured: dict, *, sharing: int = 1, gbps: float | None = None):
  """A :class:`jaxcomp.perfmodel.Link` from a group's measured all-reduces
  (``{"group": p, "small_s": 4 bytes, "big_s": 4 MiB}``): alpha from the
  small one's ``2 (p - 1)`` start-ups, beta from the big one's extra time
  over the ring's bytes of ``sharing`` groups at once through one link
  (across processes: one group per device of a process); with ``gbps``
  (a ``tc`` rate) that bandwidth instead of the measured one."""
  from jaxcomp import perfmodel as pm  # pylint: disable=g-import-not-at-top
  from jaxcomp import wire  # pylint: disable=g-import-not-at-top
  p = measured["group"]
  alpha = measured["small_s"] / wire.ring_messages("all-reduce", p)
  if gbps is not None:
    return pm.Link.from_bandwidth(gbps, alpha)
  beta = (max(measured["big_s"] - measured["small_s"], 1e-12)
          / (sharing * wire.ring_bytes("all-reduce", 4 << 20, p)))
  return pm.Link(alpha, beta)


def add_cluster_flags(ap, *, port: int, timeout: float) -> None:
  """The options every rate-limited benchmark takes: the coordinator port,
  the namespaces' prefix and subnet, a per-link timeout, a JSON output, and
  the hidden ones its workers are started with."""
  import argparse  # pylint: disable=g-import-not-at-top
  ap.add_argument("--port", type=int, default=port)
  ap.add_argument("--netns-prefix", default=None,
                  help="namespace name prefix (default: j<pid>, unique)")
  ap.add_argument("--subnet", default=None,
                  help="the namespaces' /24 (default derived from the pid)")
  ap.add_argument("--timeout", type=float, default=timeout, help="seconds per link")
  ap.add_argument("--json", help="also write the raw results here")
  ap.add_argument("--report", metavar="JSON",
                  help="print the table from a run's --json instead of running "
                  "(the other options must match that run's)")
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
  ap.add_argument("--coordinator", help=argparse.SUPPRESS)


def run_links(name: str, args, nproc: int, script: str, extra: Sequence[str], *,
              cwd: str):
  """Runs ``script --worker --rank i --coordinator HOST:PORT *extra`` in
  ``nproc`` rate-limited namespaces once per link of ``args.links`` (options
  of :func:`add_cluster_flags`) and returns ``{link: process 0's result}``
  (:meth:`RateLimitedCluster.run_result`), or an exit code after printing
  why: 2 without namespaces, 1 when a worker failed or timed out."""
  try:
    check_prerequisites()
  except NetnsUnavailable as e:
    print(f"{name} needs network namespaces: {e}", file=sys.stderr)
    return 2
  results = {}
  with RateLimitedCluster(nproc, prefix=args.netns_prefix,
                          subnet=args.subnet) as cluster:
    for link in args.links:
      cluster.set_rate(None if link == "unlimited" else link)
      try:
        results[link] = cluster.run_result(
            lambda i, host: [sys.executable, script, "--worker", "--rank", str(i),
                             "--coordinator", f"{host}:{args.port}", *extra],
            cwd=cwd, timeout=args.timeout)
      except RuntimeError as e:
        print(f"{link}: {e}", file=sys.stderr)
        return 1
  return results


def results_or_run(name: str, args, nproc: int, script: str, extra: Sequence[str],
                   *, cwd: str):
  """``{link: result}`` from a saved run (``args.report``, a ``--json``
  file) or from :func:`run_links` (an exit code where that fails)."""
  if getattr(args, "report", None):
    import json  # pylint: disable=g-import-not-at-top
    with open(args.report) as f:
      return json.load(f)
  return run_links(name, args, nproc, script, extra, cwd=cwd)


def report(header, rows, results, json_path: str | None) -> int:
  """Prints ``rows`` under ``header`` (columns padded to their widest
  cell), writes ``results`` as JSON to ``json_path`` if given; returns 0."""
  import json  # pylint: disable=g-import-not-at-top
  widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
  for row in [header, tuple("-" * w for w in widths), *rows]:
    print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
  if json_path:
    with open(json_path, "w") as f:
      json.dump(results, f, indent=1)
  return 0


def _exit_on_sigterm(signum, frame):
  del frame
  raise SystemExit(128 + signum)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _delete(name: str) -> None:
  """Kills every process inside namespace ``name``, deletes it and its
  ``/etc/netns`` folder."""
  pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
  for pid in pids:
    try:
      os.kill(int(pid), signal.SIGKILL)
    except (ProcessLookupError, ValueError):
      pass
  _run("ip", "netns", "del", name, check=False)
  shutil.rmtree(os.path.join("/etc/netns", name), ignore_errors=True)


def _delete_matching(match) -> list[str]:
  r = _run("ip", "netns", "list", check=False)
  gone = []
  for line in r.stdout.splitlines():
    name = line.split()[0] if line.split() else ""
    if name and match(name):
      _delete(name)
      gone.append(name)
  if gone:
    time.sleep(0.2)
  return gone


def _bits_per_second(rate: str) -> float | None:
  """``rate`` in tc syntax ("100mbit") as bit/s; None if not of that form."""
  m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)?bit", rate.lower())
  if not m:
    return None
  return float(m.group(1)) * {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def _default_burst(rate: str) -> str:
  bits = _bits_per_second(rate)
  if bits is None:
    return "256kb"
  return f"{max(64, int(bits / 8 / 1000 / 1024))}kb"  # ~1 ms of traffic


def burst_for(rate: str, ms: float) -> str:
  """A tbf burst of ``ms`` milliseconds of traffic at ``rate`` (tc syntax),
  at least two full-size Ethernet frames (3 KiB). A small burst makes the
  link serialise a short message at the rate, as a real link of that rate
  does; tbf's default here (1 ms, at least 64 KiB) lets up to 64 KiB
  through at once."""
  bits = _bits_per_second(rate)
  if bits is None:
    raise ValueError(f"rate must be like '100mbit', got {rate!r}")
  return f"{max(3, int(bits / 8 * ms / 1000 / 1024))}kb"
