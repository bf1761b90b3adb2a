"""The failure timeline of elastic islands (jaxcomp.elastic) for N islands
on one machine: every survivor's next commit after a SIGKILL, and what a
refused joiner costs the healthy islands.

N islands of one JAX process each (``examples/elastic/island.py``, the
regression model, ``--dim 32``, H = 6 inner steps of 50 ms), localhost, the
Lighthouse in this process (heartbeat timeout ``--heartbeat-ms``, join
timeout 5 s, at least 2 islands). The islands start with ``--wait-for N``
(a clean start: the first commit has all N). Once every island committed
``--kill-after`` outer steps, island ``i{N//2}`` (not a neighbour of
``i0`` in a ring) is SIGKILLed in the middle of an interval and not
restarted. Per survivor: seconds from the kill to its failed sync, and to
its next commit, with how many islands. Then a joiner with another model
(``--dim 16``) starts; it is refused at its heal and exits; the healthy
islands' syncs from its start to two commits after its exit are counted
(an uncommitted one is an interval the joiner cost)::

  python benchmarks/elastic_failures.py --islands 4 6 8 \\
      --out benchmarks/results/elastic_failures.txt
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import _island_logs  # noqa: E402

from jaxcomp import elastic  # noqa: E402

ISLAND = os.path.join(ROOT, "examples", "elastic", "island.py")
_events, _wait = _island_logs.events, _island_logs.wait


def _syncs(events):
  return [e for e in events if e["event"] == "sync"]


def run(n: int, args, tmp: str) -> dict:
  """One run of ``n`` islands; returns its timeline."""
  server = elastic.lighthouse("[::]:0", min_replicas=2,
                              join_timeout_ms=5000,
                              heartbeat_timeout_ms=args.heartbeat_ms)
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  stop = os.path.join(tmp, "stop")
  procs = {}

  def start(name, *extra):
    cmd = [sys.executable, ISLAND, "--island", name, "--lighthouse",
           server.address(), "--sync-every", "6", "--step-delay", "0.05",
           "--timeout", "10", "--quorum-timeout", "300", "--stop-file", stop,
           "--outer-steps", "1000", "--log",
           os.path.join(tmp, f"{name}.jsonl"), *extra]
    procs[name] = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=open(
            os.path.join(tmp, f"{name}.out"), "w"), stderr=subprocess.STDOUT)

  names = [f"i{k}" for k in range(n)]
  log = lambda name: _events(os.path.join(tmp, f"{name}.jsonl"))
  t_launch = time.time()
  try:
    for name in names:
      start(name, "--dim", "32", "--wait-for", str(n))
    _wait(lambda: all(any(e["committed"] and e["step"] >= args.kill_after
                          for e in _syncs(log(m))) for m in names),
          600, "every island's first commits")
    first = {m: next(e for e in _syncs(log(m)) if e["committed"])
             for m in names}
    victim = names[n // 2]
    mid = _wait(lambda: [e for e in log(victim) if e["event"] == "mid"
                         and e["step"] >= args.kill_after + 1], 120,
                "the victim's interval")[0]
    procs[victim].send_signal(signal.SIGKILL)
    t_kill = time.time()
    procs[victim].wait()
    survivors = [m for m in names if m != victim]
    _wait(lambda: all(any(e["committed"] and e["t"] > t_kill
                          for e in _syncs(log(m))) for m in survivors),
          120, "the survivors' next commits")
    per = {}
    for m in survivors:
      after = [e for e in _syncs(log(m)) if e["t"] > t_kill]
      failed = [e for e in after if not e["committed"]]
      nxt = next(e for e in after if e["committed"])
      per[m] = {"failed_after_s": failed[0]["t"] - t_kill if failed else None,
                "discarded": len([e for e in failed if e["t"] < nxt["t"]]),
                "next_commit_s": nxt["t"] - t_kill,
                "next_commit_islands": nxt["islands"]}
    # A joiner with another model: refused at its heal.
    t_join = time.time()
    start("x", "--dim", "16")
    procs["x"].wait(timeout=300)
    refused_code = procs["x"].returncode
    refused_said = "ElasticConfigError" in open(
        os.path.join(tmp, "x.out")).read()
    t_gone = time.time()
    step_gone = max(e["step"] for m in survivors for e in _syncs(log(m)))
    _wait(lambda: all(any(e["committed"] and e["step"] >= step_gone + 2
                          for e in _syncs(log(m))) for m in survivors),
          120, "two commits after the refused joiner")
    lost_to_joiner = {m: len([e for e in _syncs(log(m)) if e["t"] > t_join
                              and not e["committed"]]) for m in survivors}
    joiner_islands = sorted({e["islands"] for m in survivors
                             for e in _syncs(log(m)) if e["t"] > t_join})
    stop_at = step_gone + 3
    with open(stop + ".tmp", "w") as f:
      f.write(str(stop_at))
    os.replace(stop + ".tmp", stop)
    for m in survivors:
      procs[m].wait(timeout=120)
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.kill()
    server.shutdown()
  nexts = [v["next_commit_s"] for v in per.values()]
  return {
      "islands": n, "victim": victim, "killed_at_step": mid["step"],
      "first_commit_islands": sorted({e["islands"] for e in first.values()}),
      "launch_to_first_commit_s": max(e["t"] for e in first.values())
      - t_launch,
      "survivors": per, "next_commit_s_min": min(nexts),
      "next_commit_s_max": max(nexts),
      "next_commit_islands": sorted({v["next_commit_islands"]
                                     for v in per.values()}),
      "discarded_max": max(v["discarded"] for v in per.values()),
      "joiner_exit_code": refused_code, "joiner_refused": refused_said,
      "joiner_seconds": t_gone - t_join,
      "intervals_lost_to_joiner": sum(lost_to_joiner.values()),
      "islands_after_joiner": joiner_islands}


def table(results: list, args, machine: str, date: str) -> str:
  """The runs as a markdown table, headed by the command and machine."""
  lines = [
      f"# python benchmarks/elastic_failures.py --islands "
      f"{' '.join(str(r['islands']) for r in results)} (one JAX process per "
      f"island, localhost, heartbeat timeout {args['heartbeat_ms']} ms, join "
      f"timeout 5000 ms, H=6 x 50 ms; {machine}, {date})",
      "| N | first commit: islands | kill -> each survivor's failed sync, s "
      "(max) | kill -> next commit, s (min / max) | with islands | intervals "
      "discarded per survivor | refused joiner: intervals lost | islands "
      "after it |",
      "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in results:
    failed = max(v["failed_after_s"] for v in r["survivors"].values())
    lines.append(
        f"| {r['islands']} | {r['first_commit_islands']} | {failed:.2f} | "
        f"{r['next_commit_s_min']:.2f} / {r['next_commit_s_max']:.2f} | "
        f"{r['next_commit_islands']} | {r['discarded_max']} | "
        f"{r['intervals_lost_to_joiner']} | {r['islands_after_joiner']} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--islands", type=int, nargs="+", default=[4, 6, 8])
  p.add_argument("--kill-after", type=int, default=2,
                 help="kill once every island committed this many steps")
  p.add_argument("--heartbeat-ms", type=int, default=2000)
  p.add_argument("--keep", default=None, help="keep the logs here")
  p.add_argument("--out", default=None)
  p.add_argument("--table-from", default=None,
                 help="print the table of a saved .json instead of running")
  args = p.parse_args(argv)
  if args.table_from:
    with open(args.table_from) as fh:
      saved = json.load(fh)
    print(table(saved["runs"], saved["args"], saved["machine"],
                saved["date"]))
    return 0
  machine = (f"{os.cpu_count()}-core {platform.machine()}, no GPU, "
             f"load average {os.getloadavg()[0]:.0f} at the start")
  date = time.strftime("%Y-%m-%d")
  results = []
  for n in args.islands:
    tmp = (os.path.join(args.keep, f"n{n}") if args.keep
           else tempfile.mkdtemp(prefix=f"elastic_failures_{n}_"))
    os.makedirs(tmp, exist_ok=True)
    results.append(run(n, args, tmp))
    print(json.dumps(results[-1]), flush=True)
  text = table(results, vars(args), machine, date)
  print(text)
  if args.out:
    with open(args.out, "w") as fh:
      fh.write(text + "\n")
    with open(os.path.splitext(args.out)[0] + ".json", "w") as fh:
      json.dump({"args": vars(args), "machine": machine, "date": date,
                 "runs": results}, fh, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
