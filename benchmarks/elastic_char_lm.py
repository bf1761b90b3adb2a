"""Elastic DiLoCo islands on the character LM: a fault-free run and one in
which an island is SIGKILLed mid-interval and restarted, side by side.

``--islands`` islands (default three: ``a``, ``b``, ``c``, ...) of
``--processes`` JAX processes each (default two) (``examples/elastic/island.py
--model char_lm``: examples/char_lm's transformer, Adam 3e-3 inside an
island, int8 blocks with error feedback across, outer Nesterov 0.7 / 0.9),
each island in its own network namespace behind a ``tc tbf`` link
(``benchmarks/netns.py``, needs root), the Lighthouse in one more. Both
runs stop at the same outer step; the faulted one kills each ``--kill
ISLAND@STEP`` island (all its processes; default ``c@4``) in the middle of
its interval once STEP outer steps are committed and restarts it
``--restart-after`` seconds later. Per run:
wall time, the final validation loss (64 held-out windows, nats per
character, island ``a``'s anchor), and for the faulted run the intervals
the survivors discarded, the inner steps the killed island lost, seconds
from the kill to the survivors' next commit, and the heal's bytes and
seconds (one value per kill). Goodput: island-intervals committed over
island-intervals run (the killed island's interval, the survivors' discarded
ones, and the intervals the dead island did not run count as lost)::

  sudo python benchmarks/elastic_char_lm.py --out benchmarks/results/elastic_char_lm.txt
  sudo python benchmarks/elastic_char_lm.py --islands 6 --processes 1 \
    --kill c@4 --kill e@14 --out benchmarks/results/elastic_char_lm_6islands.txt
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import _island_logs  # noqa: E402
import netns  # noqa: E402

from jaxcomp import launch  # noqa: E402

ISLAND = os.path.join(ROOT, "examples", "elastic", "island.py")
_events, _wait = _island_logs.events, _island_logs.wait


def _names(n: int) -> str:
  return "abcdefghijklmnopqrstuvwxyz"[:n]


def _kill(spec: str) -> tuple[str, int]:
  name, _, step = spec.partition("@")
  if len(name) != 1 or not step.isdigit():
    raise argparse.ArgumentTypeError(f"expected ISLAND@STEP, got {spec!r}")
  return name, int(step)


def _kill_stats(args, log, syncs, kills, i: int) -> dict:
  """The i-th kill's costs, from island a's syncs up to the next kill."""
  name, mid, t_kill = kills[i]
  t_end = kills[i + 1][2] if i + 1 < len(kills) else float("inf")
  failed = [e for e in syncs if not e["committed"] and t_kill < e["t"] < t_end]
  nxt = [e for e in syncs if e["committed"] and e["t"] > t_kill][0]
  tag = name + "2"
  heal = [e for e in log(tag) if e["event"] == "begin" and e["healed"]]
  last = [e for e in log(name) if e["event"] == "sync" and e["committed"]]
  first = [e for e in log(tag) if e["event"] == "sync" and e["committed"]]
  return dict(
      killed_at_step=mid["step"],
      discarded_intervals=len(failed),
      killed_inner_steps_lost=(mid["step"] - last[-1]["step"])
      * args.sync_every + args.sync_every // 2 + 1,
      seconds_to_next_commit=nxt["t"] - t_kill,
      next_commit_islands=nxt["islands"],
      heal_bytes=heal[0]["heal_bytes"] if heal else None,
      heal_seconds=heal[0]["heal_seconds"] if heal else None,
      # None: the survivors finished before it was back.
      rejoined_at_step=first[0]["step"] if first else None,
      restored_step=[e for e in log(tag) if e["event"] == "ready"][0]
      ["restored"])


def run(args, cluster, tmp: str, faulted: bool) -> dict:
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  port = 29510
  lh_out = os.path.join(tmp, "lighthouse.out")
  cluster.popen(0, [sys.executable, "-m", "jaxcomp.cli", "lighthouse",
                    "--bind", f"0.0.0.0:{port}", "--min-replicas", "2",
                    "--heartbeat-timeout-ms", str(args.heartbeat_ms)],
                env=env, stdout=open(lh_out, "w"), stderr=subprocess.STDOUT)
  _wait(lambda: "http" in open(lh_out).read(), 60, "the Lighthouse")
  lighthouse = f"http://{cluster.namespaces[0].address}:{port}"
  procs: dict[str, list] = {}
  go = os.path.join(tmp, "go")

  def start(name, tag, ns):
    coord = launch.free_port()
    procs[tag] = []
    for r in range(args.processes):
      e = {**env, "JAXCOMP_COORDINATOR_ADDRESS": f"127.0.0.1:{coord}",
           "JAXCOMP_NUM_PROCESSES": str(args.processes),
           "JAXCOMP_PROCESS_ID": str(r)}
      cmd = [sys.executable, ISLAND, "--island", name, "--lighthouse",
             lighthouse, "--model", "char_lm", "--dim", str(args.d_model),
             "--batch-size", str(args.batch_size), "--sync-every",
             str(args.sync_every), "--outer-steps", str(args.outer_steps),
             "--compressor", args.compressor, "--timeout", "30",
             "--quorum-timeout", "300", "--checkpoint-dir",
             os.path.join(tmp, "ckpt"), "--go-file", go,
             "--log", os.path.join(tmp, f"{tag}.p{{process}}.jsonl")]
      procs[tag].append(cluster.popen(
          ns, cmd, env=e, cwd=ROOT, stdout=open(
              os.path.join(tmp, f"{tag}.p{r}.out"), "w"),
          stderr=subprocess.STDOUT))

  names = _names(args.islands)
  for k, name in enumerate(names):
    start(name, name, k + 1)
  log = lambda tag: _events(os.path.join(tmp, f"{tag}.p0.jsonl"))
  _wait(lambda: all(any(e["event"] == "ready" for e in log(n)) for n in names),
        600, f"{len(names)} ready islands")
  t0 = time.time()
  open(go, "w").close()
  out: dict = {"faulted": faulted}
  kills = []  # (island, its mid event, time of the kill)
  for name, after in (args.kill if faulted else []):
    mid = _wait(lambda: [e for e in log(name) if e["event"] == "mid"
                         and e["step"] >= after], 1800, f"{name}'s interval")
    for p in procs[name]:
      p.send_signal(signal.SIGKILL)
    kills.append((name, mid[0], time.time()))
    for p in procs[name]:
      p.wait()
    time.sleep(args.restart_after)
    start(name, name + "2", names.index(name) + 1)
  out["killed_at_step"] = [m["step"] for _, m, _ in kills]
  for tag, ps in procs.items():
    if tag in [k[0] for k in kills]:
      continue
    for p in ps:
      p.wait(timeout=1800)
      if p.returncode:
        raise RuntimeError(f"island {tag} failed ({p.returncode}); see {tmp}")
  a = log("a")
  done = [e for e in a if e["event"] == "done"][0]
  syncs = [e for e in a if e["event"] == "sync"]
  out.update(seconds=done["t"] - t0, steps=done["step"],
             valid_loss=done["valid_loss"], final_loss=syncs[-1]["loss"])
  n = len(names)
  per_kill = [_kill_stats(args, log, syncs, kills, i) for i in range(len(kills))]
  for key in ("discarded_intervals", "killed_inner_steps_lost",
              "seconds_to_next_commit", "next_commit_islands", "heal_bytes",
              "heal_seconds", "rejoined_at_step", "restored_step"):
    out[key] = [k[key] for k in per_kill]
  # Island-intervals: n per outer step; lost per kill: the killed island's,
  # the survivors' discarded ones, and those it did not run while down.
  failed = sum(k["discarded_intervals"] for k in per_kill)
  total = n * (out["steps"] + failed)
  lost = sum((n - 1) * k["discarded_intervals"] + 1
             + max(0, (k["rejoined_at_step"] or out["steps"] + 1) - 1
                   - k["killed_at_step"])
             for k in per_kill)
  out["goodput"] = (total - lost) / total
  cluster.kill_all()
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--rate", default="100mbit", help="tc rate of every link")
  p.add_argument("--processes", type=int, default=2, help="per island")
  p.add_argument("--outer-steps", type=int, default=30)
  p.add_argument("--sync-every", type=int, default=10, help="H")
  p.add_argument("--d-model", type=int, default=64)
  p.add_argument("--batch-size", type=int, default=16, help="per island")
  p.add_argument("--compressor", default="int8_block")
  p.add_argument("--islands", type=int, default=3,
                 help="named a, b, c, ...; island a is never killed")
  p.add_argument("--kill", type=_kill, action="append", default=None,
                 metavar="ISLAND@STEP",
                 help="in the faulted run, kill ISLAND mid-interval after "
                 "STEP commits (repeatable; default c@4)")
  p.add_argument("--restart-after", type=float, default=2.0)
  p.add_argument("--heartbeat-ms", type=int, default=2000)
  p.add_argument("--runs", nargs="+", default=["fault-free", "faulted"],
                 choices=["fault-free", "faulted"])
  p.add_argument("--keep", default=None,
                 help="keep the runs' logs in this folder")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  args.kill = sorted(args.kill or [("c", 4)], key=lambda k: k[1])
  killed = [k[0] for k in args.kill]
  if not 2 <= args.islands <= 26 or len(set(killed)) < len(killed) or any(
      k not in _names(args.islands)[1:] for k in killed):
    p.error("--islands is 2..26 and each --kill names a distinct island "
            "other than a")
  results = []
  for name in args.runs:
    tmp = (os.path.join(args.keep, name) if args.keep
           else tempfile.mkdtemp(prefix=f"elastic_{name}_"))
    os.makedirs(tmp, exist_ok=True)
    with netns.RateLimitedCluster(args.islands + 1) as cluster:
      cluster.set_rate(args.rate)
      results.append(run(args, cluster, tmp, name == "faulted"))
      print(json.dumps(results[-1]), flush=True)
  if len(results) < 2:
    return 0
  clean, fault = results
  lines = [
      f"# python benchmarks/elastic_char_lm.py ({args.islands} islands x "
      f"{args.processes} "
      f"JAX processes, netns links {args.rate}, H={args.sync_every}, "
      f"{args.outer_steps} outer steps, {args.compressor}, d_model "
      f"{args.d_model}, batch {args.batch_size} per island)",
      "| run | wall s | outer steps | valid loss | goodput | discarded "
      "intervals | killed island's inner steps lost | s to next commit | "
      "heal bytes | heal s | rejoined at step |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  killed = ", ".join(f"{k[0]}@{k[1]}" for k in args.kill)
  label = f"island{'s' * (len(args.kill) > 1)} {killed} killed"
  for name, r in (("fault-free", clean), (label, fault)):
    f = lambda k, fmt="{}": " / ".join(
        "-" if v is None else fmt.format(v) for v in r.get(k) or [None])
    lines.append(
        f"| {name} | {r['seconds']:.1f} | {r['steps']} | {r['valid_loss']:.4f} "
        f"| {r['goodput']:.3f} | {f('discarded_intervals')} | "
        f"{f('killed_inner_steps_lost')} | "
        f"{f('seconds_to_next_commit', '{:.2f}')} | {f('heal_bytes')} | "
        f"{f('heal_seconds', '{:.2f}')} | {f('rejoined_at_step')} |")
  diff = (fault["valid_loss"] - clean["valid_loss"]) / clean["valid_loss"]
  lines.append(f"valid loss, faulted vs fault-free: {100 * diff:+.2f}%")
  text = "\n".join(lines)
  print(text)
  if args.out:
    with open(args.out, "w") as fh:
      fh.write(text + "\n")
    with open(os.path.splitext(args.out)[0] + ".json", "w") as fh:
      json.dump({"args": vars(args), "runs": results}, fh, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
