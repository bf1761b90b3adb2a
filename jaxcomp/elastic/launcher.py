"""Starting elastic islands on one machine: ``jaxcomp islands`` (the
Lighthouse and ``N`` islands of ``M`` JAX processes each, restarted when
they fail) and ``jaxcomp lighthouse`` (torchft's quorum service alone, for
islands on several machines).

:func:`add_islands_command` and :func:`add_lighthouse_command` add the two
subcommands to the ``jaxcomp`` command line (:mod:`jaxcomp.cli`);
:func:`run_islands` is the first as a function.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from jaxcomp.elastic._island import lighthouse


def _island_env(name: str, address: str, wait_for: int) -> dict[str, str]:
  return {**os.environ, "JAXCOMP_ISLAND": name,
          "JAXCOMP_LIGHTHOUSE": address, "JAXCOMP_WAIT_FOR": str(wait_for)}


def advertised(server, advertise: str | None = None) -> str:
  """The address islands dial for the Lighthouse ``server``:
  ``http://ADVERTISE:PORT`` with the port it listens on, or torchft's own
  (``http://<this machine's hostname>:PORT``) when ``advertise`` is None.

  Args:
    server: what :func:`jaxcomp.elastic.lighthouse` returns.
    advertise: a host name or address the islands reach this machine at
      (an IPv6 address in brackets, ``[fd00::1]``), or None.
  """
  address = server.address()
  if not advertise:
    return address
  return f"http://{advertise}:{address.rsplit(':', 1)[1]}"


def _pump(stream, prefix: str) -> None:
  for line in iter(stream.readline, b""):
    sys.stdout.write(f"{prefix} {line.decode(errors='replace')}")
    sys.stdout.flush()


def _start_island(name: str, command: Sequence[str], processes: int,
                  address: str, wait_for: int) -> subprocess.Popen:
  argv = list(command)
  if processes > 1:  # jaxcomp.launch: one JAX job of `processes` processes
    argv = [sys.executable, "-m", "jaxcomp.cli", "launch", "-n", str(processes),
            "--", *argv]
  proc = subprocess.Popen(argv, env=_island_env(name, address, wait_for),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  threading.Thread(target=_pump, args=(proc.stdout, f"[{name}]"),
                   daemon=True).start()
  return proc


def run_islands(command: Sequence[str], islands: int, *, processes: int = 1,
                min_replicas: int | None = None,
                wait_for: int | None = None,
                heartbeat_timeout_ms: int = 2000,
                join_timeout_ms: int = 5000,
                restart_delay: float | None = None,
                max_restarts: int = 3, bind: str = "[::]:0",
                advertise: str | None = None) -> int:
  """Starts the Lighthouse and ``islands`` islands of ``processes`` JAX
  processes each on this machine, and waits for them.

  Each island runs ``command`` with ``JAXCOMP_ISLAND`` (its name: ``i0``,
  ``i1``, ..., ``i{islands-1}``, kept when it is restarted; its checkpoint
  folder under ``checkpoint_dir``), ``JAXCOMP_LIGHTHOUSE`` (the
  Lighthouse's address) and ``JAXCOMP_WAIT_FOR`` in its environment, which
  :class:`ElasticDiLoCo` reads when ``island``, ``lighthouse`` and
  ``wait_for`` are not given; several processes per island go through
  ``jaxcomp launch -n processes``. Output lines are prefixed
  with ``[<island>]``.

  Args:
    command: the island program and its arguments.
    islands: how many islands, >= 1.
    processes: JAX processes per island, >= 1.
    min_replicas: the Lighthouse's minimum quorum; default 2 when there are
      several islands (a restarted island never forms a quorum alone), else 1.
    wait_for: islands the run waits for before its first commit
      (:class:`ElasticDiLoCo`'s ``wait_for``); default all ``islands``.
    heartbeat_timeout_ms, join_timeout_ms: the Lighthouse's (see
      :func:`lighthouse`).
    restart_delay: restart an island that exits non-zero (a SIGKILL
      included) after this many seconds, at most ``max_restarts`` times per
      island; None: do not restart.
    max_restarts: restarts allowed per island.
    bind: ``host:port`` the Lighthouse listens on; port 0 picks a free one.
    advertise: the host the islands dial the Lighthouse at (see
      :func:`advertised`); default torchft's, this machine's hostname.

  Returns:
    0 when every island exited 0, else the last failing island's exit
    status (128 + signal number for a signal).

  Raises:
    ValueError: ``islands``, ``processes`` or ``wait_for`` below 1, an
      empty command.
  """
  wait_for = islands if wait_for is None else wait_for
  if islands < 1 or processes < 1 or wait_for < 1 or not command:
    raise ValueError(f"need islands, processes, wait_for >= 1 and a command, "
                     f"got {islands=}, {processes=}, {wait_for=}, {command=}")
  server = lighthouse(bind, min_replicas=min_replicas or min(2, islands),
                      join_timeout_ms=join_timeout_ms,
                      heartbeat_timeout_ms=heartbeat_timeout_ms)
  address = advertised(server, advertise)
  print(f"[lighthouse] {address}", flush=True)
  names = [f"i{k}" for k in range(islands)]
  procs = {n: _start_island(n, command, processes, address, wait_for)
           for n in names}
  restarts = dict.fromkeys(names, 0)
  due: dict[str, float] = {}
  status = 0
  try:
    while procs or due:
      for name, proc in list(procs.items()):
        code = proc.poll()
        if code is None:
          continue
        del procs[name]
        code = 128 - code if code < 0 else code
        print(f"[{name}] exited with status {code}", flush=True)
        if code and restart_delay is not None and (
            restarts[name] < max_restarts):
          restarts[name] += 1
          due[name] = time.monotonic() + restart_delay
        elif code:
          status = code
      for name, at in list(due.items()):
        if time.monotonic() >= at:
          del due[name]
          print(f"[{name}] restarting ({restarts[name]} of {max_restarts})",
                flush=True)
          procs[name] = _start_island(name, command, processes, address,
                                      wait_for)
      time.sleep(0.1)
  finally:
    for proc in procs.values():
      proc.kill()
    server.shutdown()
  return status


def _run_islands_command(args: argparse.Namespace) -> int:
  cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
  return run_islands(cmd, args.islands, processes=args.processes,
                     min_replicas=args.min_replicas,
                     wait_for=args.wait_for,
                     heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                     join_timeout_ms=args.join_timeout_ms,
                     restart_delay=args.restart_delay,
                     max_restarts=args.max_restarts, bind=args.bind,
                     advertise=args.advertise)


def _run_lighthouse_command(args: argparse.Namespace) -> int:
  server = lighthouse(args.bind, min_replicas=args.min_replicas,
                      join_timeout_ms=args.join_timeout_ms,
                      heartbeat_timeout_ms=args.heartbeat_timeout_ms)
  print(advertised(server, args.advertise), flush=True)
  try:
    while True:
      time.sleep(3600)
  except KeyboardInterrupt:
    server.shutdown()
  return 0


def add_islands_command(subparsers) -> argparse.ArgumentParser:
  """Adds ``islands`` to ``subparsers`` (an ``add_subparsers()`` result):
  ``jaxcomp islands -n 3 -m 2 -- python island.py ...`` runs
  :func:`run_islands` and exits with its status. Returns the subparser;
  its ``func(args)`` default runs it."""
  isl = subparsers.add_parser(
      "islands", help="run the Lighthouse and N elastic DiLoCo islands of M "
      "JAX processes each on this machine",
      description="Runs torchft's Lighthouse and N elastic DiLoCo islands "
      "of M JAX processes each on this machine. The islands are named i0, "
      "i1, ..., i{N-1} (JAXCOMP_ISLAND; a restarted island keeps its name, "
      "and its checkpoint folder); each also gets JAXCOMP_LIGHTHOUSE (the "
      "Lighthouse's address) and JAXCOMP_WAIT_FOR. Output lines are "
      "prefixed with [<island>].")
  isl.add_argument("-n", "--islands", type=int, default=2)
  isl.add_argument("-m", "--processes", type=int, default=1,
                   help="JAX processes per island (jaxcomp launch)")
  isl.add_argument("--min-replicas", type=int, default=None,
                   help="the Lighthouse's minimum quorum (default 2, 1 for "
                   "one island)")
  isl.add_argument("--wait-for", type=int, default=None,
                   help="islands the run waits for before its first commit "
                   "(default: all N)")
  isl.add_argument("--bind", default="[::]:0",
                   help="HOST:PORT the Lighthouse listens on (default "
                   "[::]:0, a free port)")
  isl.add_argument("--advertise", default=None,
                   help="HOST the islands dial the Lighthouse at (default: "
                   "this machine's hostname)")
  isl.add_argument("--join-timeout-ms", type=int, default=5000)
  isl.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
  isl.add_argument("--restart-delay", type=float, default=None,
                   help="restart a failed island after this many seconds")
  isl.add_argument("--max-restarts", type=int, default=3)
  isl.add_argument("cmd", nargs=argparse.REMAINDER,
                   help="-- then the island's command")
  isl.set_defaults(func=_run_islands_command)
  return isl


def add_lighthouse_command(subparsers) -> argparse.ArgumentParser:
  """Adds ``lighthouse`` to ``subparsers``: ``jaxcomp lighthouse --bind
  '[::]:29510' --min-replicas 2`` runs torchft's Lighthouse until
  interrupted, its address printed first. Returns the subparser; its
  ``func(args)`` default runs it."""
  lh = subparsers.add_parser(
      "lighthouse", help="run torchft's quorum service for elastic islands")
  lh.add_argument("--bind", default="[::]:29510",
                  help="HOST:PORT to listen on")
  lh.add_argument("--advertise", default=None,
                  help="HOST the islands dial (printed as http://HOST:PORT; "
                  "default: this machine's hostname)")
  lh.add_argument("--min-replicas", type=int, default=1)
  lh.add_argument("--join-timeout-ms", type=int, default=5000)
  lh.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
  lh.set_defaults(func=_run_lighthouse_command)
  return lh


if __name__ == "__main__":  # a library module: its command is on the CLI
  sys.exit("jaxcomp.elastic.launcher is not a command: run `jaxcomp islands ...` "
           "(or `python -m jaxcomp islands ...`)")
