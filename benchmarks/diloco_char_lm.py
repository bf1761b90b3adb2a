"""DiLoCo and DeMo on the character LM: validation loss against bytes over the run.

Trains ``examples.char_lm`` (8 simulated CPU devices) with dense data
parallelism and with DiLoCo (``diloco_every=H``: the optimizer per device,
a pseudo-gradient exchange every H steps, outer Nesterov SGD 0.7 / 0.9),
its pseudo-gradients dense or compressed (4-bit blocks as Streaming DiLoCo
and INTELLECT-1; top-k with 2-bit values and error feedback as SparseLoCo),
Streaming DiLoCo (F fragments on a staggered schedule) and DeMo, and
prints one row per run: validation loss, its difference to dense data
parallelism's, bytes one device hands to collectives over the run and the
factor fewer than dense.

The example's defaults (300 steps, Adam 3e-3), the six rows of
``benchmarks/results/diloco_char_lm.txt``::

  python benchmarks/diloco_char_lm.py --out benchmarks/results/diloco_char_lm.txt

The 3600-step runs at docs/convergence.md's LM length, model and devices,
with Adam 3e-3 and a cosine schedule for data parallelism and as DiLoCo's
inner optimizer (the paper's inner AdamW), and a plot of validation loss
against total bytes::

  python benchmarks/diloco_char_lm.py --steps 3600 --optimizer adam \\
      --lr 3e-3 --schedule cosine --runs dp h50 h50_int4 h50_sparseloco \\
      h100_int4 h100_int4_sgd15 h10 h100 h100_sparseloco \\
      stream_f4_h100_int4 demo \\
      --jsonl benchmarks/results/diloco_char_lm_3600.jsonl --resume \\
      --plot docs/convergence_lowcomm.png \\
      --out benchmarks/results/diloco_char_lm_3600.txt

The sweep of what costs DiLoCo at this budget (the ``h1_sgd1``,
``h10_sgd1`` and ``h100_int4_*`` rows: the outer step, the inner learning
rate) is docs/convergence.md's second table, written to
``benchmarks/results/diloco_char_lm_3600_sweep.txt`` by the command there.

(With docs/convergence.md's momentum SGD 0.3 as the inner optimizer,
DiLoCo H=10 ended at 2.9495 against data parallelism's 1.3809: at a
per-device batch of 4, that learning rate sends the workers apart.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples import xla_flags  # noqa: E402  (imports no jax)

_INT4 = dict(compressor="int8_block", bits=4)
# SparseLoCo: error feedback in place of the outer momentum (outer SGD 1.0).
_SPARSELOCO = dict(compressor="topk", ratio=0.02, value_bits=2,
                   diloco_outer_lr=1.0, diloco_outer_momentum=0.0)
_DENSE = dict(compressor="identity")
_H100_INT4 = dict(_INT4, diloco_every=100)


def _sgd(lr: float) -> dict:
  """Outer SGD without momentum (1.0: parameter averaging)."""
  return dict(diloco_outer_lr=lr, diloco_outer_momentum=0.0)


# name: (label, Config fields). "dp" is the baseline of the relative columns.
RUNS = {
    "dp": ("data parallel, dense", dict(compressor="identity")),
    "h10": ("DiLoCo H=10, dense", dict(compressor="identity", diloco_every=10)),
    "h10_int4": ("DiLoCo H=10, int8 blocks 4-bit", dict(_INT4, diloco_every=10)),
    "h10_topk5": ("DiLoCo H=10, top-k 5% + EF",
                  dict(compressor="topk", ratio=0.05, diloco_every=10)),
    "h50": ("DiLoCo H=50, dense", dict(compressor="identity", diloco_every=50)),
    "h50_int4": ("DiLoCo H=50, int8 blocks 4-bit", dict(_INT4, diloco_every=50)),
    "h100": ("DiLoCo H=100, dense", dict(compressor="identity", diloco_every=100)),
    "h100_int4": ("DiLoCo H=100, int8 blocks 4-bit", dict(_INT4, diloco_every=100)),
    "h50_sparseloco": ("DiLoCo H=50, top-k 2% 2-bit values + EF, outer SGD 1.0 (SparseLoCo)",
                       dict(_SPARSELOCO, diloco_every=50)),
    "h100_sparseloco": ("DiLoCo H=100, top-k 2% 2-bit values + EF, outer SGD 1.0 (SparseLoCo)",
                        dict(_SPARSELOCO, diloco_every=100)),
    "stream_f4_h100_int4": ("Streaming DiLoCo H=100 F=4, int8 blocks 4-bit",
                            dict(_INT4, diloco_every=100, diloco_fragments=4)),
    "demo": ("DeMo (topk 32 of 64x64 DCT chunks)", dict(optimizer="demo")),
    # What costs DiLoCo at this budget (docs/convergence.md's sweep): the
    # inner learning rate and the outer step. h1_sgd1 is a diagnostic: every
    # step averaged (no drift) with outer SGD 1.0, so the only difference
    # from data parallelism is Adam per device on its own 4 windows.
    "h1_sgd1": ("DiLoCo H=1, dense, outer SGD 1.0 (per-device Adam, averaged every step)",
                dict(_DENSE, diloco_every=1, **_sgd(1.0))),
    "h10_sgd1": ("DiLoCo H=10, dense, outer SGD 1.0 (parameter averaging)",
                 dict(_DENSE, diloco_every=10, **_sgd(1.0))),
    "h100_int4_lr1e3": ("DiLoCo H=100, int8 blocks 4-bit, inner Adam 1e-3",
                        dict(_H100_INT4, learning_rate=1e-3)),
    "h100_int4_lr5e4": ("DiLoCo H=100, int8 blocks 4-bit, inner Adam 5e-4",
                        dict(_H100_INT4, learning_rate=5e-4)),
    "h100_int4_outer1": ("DiLoCo H=100, int8 blocks 4-bit, outer Nesterov lr 1.0",
                         dict(_H100_INT4, diloco_outer_lr=1.0)),
    "h100_int4_lr1e3_outer05": (
        "DiLoCo H=100, int8 blocks 4-bit, inner Adam 1e-3, outer Nesterov lr 0.5",
        dict(_H100_INT4, learning_rate=1e-3, diloco_outer_lr=0.5)),
    "h100_int4_n1_m03": ("DiLoCo H=100, int8 blocks 4-bit, outer Nesterov 1.0 / 0.3",
                         dict(_H100_INT4, diloco_outer_lr=1.0, diloco_outer_momentum=0.3)),
    "h100_int4_sgd1": ("DiLoCo H=100, int8 blocks 4-bit, outer SGD 1.0 (parameter averaging)",
                       dict(_H100_INT4, **_sgd(1.0))),
    "h100_int4_lr1e3_sgd1": ("DiLoCo H=100, int8 blocks 4-bit, inner Adam 1e-3, outer SGD 1.0",
                             dict(_H100_INT4, learning_rate=1e-3, **_sgd(1.0))),
    "h100_int4_sgd15": ("DiLoCo H=100, int8 blocks 4-bit, outer SGD 1.5",
                        dict(_H100_INT4, **_sgd(1.5))),
    "h100_int4_sgd2": ("DiLoCo H=100, int8 blocks 4-bit, outer SGD 2.0",
                       dict(_H100_INT4, **_sgd(2.0))),
    "h100_int4_sgd3": ("DiLoCo H=100, int8 blocks 4-bit, outer SGD 3.0",
                       dict(_H100_INT4, **_sgd(3.0))),
    "h100_sparseloco_sgd15": ("DiLoCo H=100, top-k 2% 2-bit values + EF, outer SGD 1.5",
                              dict(_SPARSELOCO, diloco_every=100, diloco_outer_lr=1.5)),
}
DEFAULT_RUNS = ("dp", "h10", "h10_int4", "h10_topk5", "h50", "h50_int4")

# The recipe sweep (docs/convergence.md, "Which low-communication recipe"):
# DiLoCo's interval H x its outer step x the pseudo-gradient's exchange,
# SparseLoCo, MuLoCo. Names: "<method>_h<H>_<exchange>_<outer>".
_OUTER = {
    "sgd1": ("outer SGD 1.0", _sgd(1.0)),
    "sgd15": ("outer SGD 1.5", _sgd(1.5)),
    "nest": ("outer Nesterov 0.7 / 0.6",
             dict(diloco_outer_lr=0.7, diloco_outer_momentum=0.6)),
    "nest09": ("outer Nesterov 0.7 / 0.9",
               dict(diloco_outer_lr=0.7, diloco_outer_momentum=0.9)),
}
_EXCHANGE = {
    "dense": ("dense", _DENSE),
    "int4": ("4-bit blocks + EF", dict(compressor="int8_block", bits=4)),
    "int2": ("2-bit blocks + EF", dict(compressor="int8_block", bits=2)),
    # SparseLoCo (Sarfi et al. 2025; the reference tplr-ai/SparseLoCo): 64
    # of each 64 x 64 chunk (1.56%), 12-bit indices within the chunk, 2-bit
    # values on the reference's statistical quantizer, error feedback with
    # decay 0.95 in place of outer momentum, each coordinate averaged over
    # the workers that sent it (the reference's scatter mean).
    "sl": ("SparseLoCo: chunked top-k 64/4096, 2-bit, EF decay 0.95, "
           "sender mean",
           dict(compressor="chunked_topk", topk=64, chunk=64, value_bits=2,
                error_feedback_decay=0.95, collective="sender_mean")),
    # The same with the paper's mean over all workers.
    "slall": ("chunked top-k 64/4096, 2-bit, EF decay 0.95, mean over all",
              dict(compressor="chunked_topk", topk=64, chunk=64, value_bits=2,
                   error_feedback_decay=0.95)),
}
_INNER = {"diloco": ("DiLoCo", {}),
          "muloco": ("MuLoCo (inner Muon)", dict(optimizer="muon"))}


def _recipe(method: str, h: int, exchange: str, outer: str):
  m_label, m_fields = _INNER[method]
  e_label, e_fields = _EXCHANGE[exchange]
  o_label, o_fields = _OUTER[outer]
  return (f"{m_label} H={h}, {e_label}, {o_label}",
          dict(e_fields, diloco_every=h, **m_fields, **o_fields))


for _m in _INNER:
  for _h in (15, 30, 50, 100):
    for _e in _EXCHANGE:
      for _o in _OUTER:
        RUNS[f"{_m}_h{_h}_{_e}_{_o}"] = _recipe(_m, _h, _e, _o)
RUNS["dp_muon"] = ("data parallel, dense, Muon", dict(compressor="identity",
                                                      optimizer="muon"))



def _plot(rows, path: str, title: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  wire = all("wire_total_bytes" in r for r in rows)
  key = "wire_total_bytes" if wire else "total_bytes"
  fig, ax = plt.subplots(figsize=(8.5, 5.4) if wire else (7.5, 4.8))
  for r in rows:
    ax.scatter(r[key] / 1e6, r["valid_loss"], s=28)
    ax.annotate(r["name"], (r[key] / 1e6, r["valid_loss"]), fontsize=6 if wire else 7,
                xytext=(4, 3), textcoords="offset points")
  base = next((r for r in rows if r["name"] == "dp"), None)
  if base:
    for pct, style in ((3, "--"), (5, ":")):
      ax.axhline(base["valid_loss"] * (1 + pct / 100), color="gray", ls=style, lw=0.8,
                 label=f"data parallel + {pct}%")
      if not wire:
        ax.axvline(base[key] / 1e6 / (500 if pct == 3 else 2000), color="gray",
                   ls=style, lw=0.8)
    if wire:
      ax.axvline(base[key] / 1e6 / 500, color="black", ls="-.", lw=0.8,
                 label="500x fewer wire bytes than data parallel")
    ax.legend(fontsize=8)
  ax.set_xscale("log")
  ax.set_xlabel("wire bytes per device over the run (MB, ring algorithms)" if wire
                else "bytes per device over the run (MB)")
  ax.set_ylabel("validation loss (nats/char)")
  ax.set_title(title, fontsize=9)
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _commit() -> str:
  """The checkout's commit, with "+dirty" when tracked files differ."""
  import subprocess  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                         capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".",
                            ":(exclude)benchmarks/results"], cwd=root).returncode
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return rev + ("+dirty" if dirty else "")


def _bytes_without_training(train, cfg: dict) -> tuple[float, float]:
  """Operand and wire bytes per device over the run of ``cfg``, from its
  transformation's statistics as ``train_and_evaluate`` reports them, with
  no training (for results reused from an earlier JSONL without wire
  bytes)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxcomp  # pylint: disable=g-import-not-at-top
  from examples import common  # pylint: disable=g-import-not-at-top
  from examples.char_lm import model as model_lib  # pylint: disable=g-import-not-at-top
  config = train.Config(**cfg)
  tx = common.stages(config, train.learning_rate_schedule(config),
                     muon_dimensions=model_lib.muon_dimensions)[-1].tx
  _, params = train.init_model(config)
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  layout = jaxcomp.Islands() if config.diloco_every else jaxcomp.DataParallel()
  state = jaxcomp.init(tx, params, mesh, layout=layout)
  stats = common.exchange_stats(state.opt_state)
  steps = config.epochs * config.steps_per_epoch / max(config.diloco_every, 1)
  return float(stats.bytes_sent) * steps, float(stats.wire_bytes) * steps


def table(results) -> str:
  """The markdown table of ``results`` (rows as the JSONL holds them): wire
  bytes (ring algorithms) and operand bytes where every row has both, else
  operand bytes only (the earlier tables)."""
  dp = next(r for r in results if r["name"] == "dp")
  rel = lambda r: f"{100 * (r['valid_loss'] / dp['valid_loss'] - 1):+.2f}%"
  if all("wire_total_bytes" in r for r in results):
    hdr = ("run", "validation loss", "vs data parallel",
           "wire bytes / device", "fewer wire bytes", "operand bytes / device",
           "fewer operand bytes", "steps", "wall s")
    rows = [(r["label"], f"{r['valid_loss']:.4f}", rel(r),
             f"{r['wire_total_bytes']:,.0f}",
             f"{dp['wire_total_bytes'] / r['wire_total_bytes']:,.1f}x",
             f"{r['total_bytes']:,.0f}",
             f"{dp['total_bytes'] / r['total_bytes']:,.1f}x",
             str(r["steps"]), f"{r['seconds']:.0f}") for r in results]
  else:
    hdr = ("run", "validation loss", "vs dense", "bytes / device over the run",
           "fewer than dense", "wall s")
    rows = [(r["label"], f"{r['valid_loss']:.4f}", rel(r),
             f"{r['total_bytes']:,.0f}",
             f"{dp['dense_total_bytes'] / r['total_bytes']:,.1f}x",
             f"{r['seconds']:.0f}") for r in results]
  return "\n".join(["| " + " | ".join(hdr) + " |", "|" + " --- |" * len(hdr)]
                   + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(DEFAULT_RUNS),
                  help="which rows to run (default: the six of the 300-step table)")
  ap.add_argument("--steps", type=int, default=None,
                  help="steps per run, one epoch (default: the example's 3 x 100)")
  ap.add_argument("--optimizer", default=None,
                  help="the (inner) optimizer (default: the example's, adam)")
  ap.add_argument("--lr", type=float, default=None, help="its learning rate")
  ap.add_argument("--schedule", default=None, help="constant or cosine")
  ap.add_argument("--demo-lr", type=float, default=3e-3,
                  help="DeMo's learning rate (its update is lr * sign)")
  ap.add_argument("--jsonl", help="append each run's result here")
  ap.add_argument("--resume", action="store_true",
                  help="skip the runs already in --jsonl (same names)")
  ap.add_argument("--reuse", help="an earlier JSONL (without wire bytes): a "
                  "run whose config equals one of its rows takes that row's "
                  "result (the runs are deterministic), its bytes recounted "
                  "from the transformation's statistics")
  ap.add_argument("--plot", help="write validation loss against total bytes here")
  ap.add_argument("--out", default=None, help="also write the table here")
  args = ap.parse_args(argv)
  xla_flags.set_cpu_devices(8)
  from examples.char_lm import train  # pylint: disable=g-import-not-at-top

  base = {"progress": False}
  if args.steps:
    base.update(epochs=1, steps_per_epoch=args.steps)
  for key, field in (("optimizer", "optimizer"), ("lr", "learning_rate"),
                     ("schedule", "lr_schedule")):
    if getattr(args, key) is not None:
      base[field] = getattr(args, key)
  done = {}
  if args.resume and args.jsonl and os.path.exists(args.jsonl):
    with open(args.jsonl) as f:
      done = {r["name"]: r for r in map(json.loads, f)}
  earlier = []
  if args.reuse:
    with open(args.reuse) as f:
      earlier = [json.loads(line) for line in f]
  names = (["dp"] if "dp" not in args.runs else []) + list(args.runs)
  results = []
  for name in names:
    label, fields = RUNS[name]
    if name in done:
      results.append(done[name])
      continue
    cfg = dict(base, **fields)
    if name == "demo":
      cfg["learning_rate"] = args.demo_lr
    same = [r for r in earlier
            if r["config"] == {k: v for k, v in cfg.items() if k != "progress"}]
    if same:
      operand, on_wire = _bytes_without_training(train, cfg)
      if abs(operand - same[0]["total_bytes"]) > 1e-9 * operand:
        raise ValueError(f"{name}: {operand} operand bytes recounted, the "
                         f"earlier run reported {same[0]['total_bytes']}")
      row = dict(same[0], name=name, label=label, wire_total_bytes=on_wire,
                 reused=f"{os.path.basename(args.reuse)}: {same[0]['name']}")
      results.append(row)
      print(f"{label}: reused {row['reused']}", flush=True)
      if args.jsonl:
        with open(args.jsonl, "a") as f:
          f.write(json.dumps(row) + "\n")
      continue
    t0 = time.perf_counter()
    r = train.train_and_evaluate(train.Config(**cfg))
    row = {"name": name, "label": label, "valid_loss": r["epochs"][-1]["valid_loss"],
           "total_bytes": r["bytes_per_step"] * r["steps"],
           "dense_total_bytes": r["dense_bytes_per_step"] * r["steps"],
           "wire_total_bytes": r["wire_bytes_per_step"] * r["steps"],
           "train_loss": r["epochs"][-1]["loss"],
           "steps": r["steps"], "seconds": time.perf_counter() - t0,
           "commit": _commit(),
           "config": {k: v for k, v in cfg.items() if k != "progress"}}
    results.append(row)
    print(f"{label}: {row['seconds']:.0f} s ({r['steps']} steps), "
          f"validation loss {row['valid_loss']:.4f}", flush=True)
    if args.jsonl:
      with open(args.jsonl, "a") as f:
        f.write(json.dumps(row) + "\n")
  dp = next(r for r in results if r["name"] == "dp")
  text = table(results)
  print(text)
  if args.plot:
    _plot(results, args.plot, f"character LM, {dp['steps']} steps, 8 devices: "
          "validation loss against bytes")
  if args.out:
    with open(args.out, "w") as f:
      f.write(f"$ python benchmarks/diloco_char_lm.py "
              f"{' '.join(argv or sys.argv[1:])}\n\n{text}\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
