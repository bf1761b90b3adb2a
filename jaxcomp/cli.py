"""The ``jaxcomp`` command line, one dispatcher of subcommands::

  jaxcomp whatif ...        # does compression pay for this model and cluster
  jaxcomp launch -n N -- cmd ...     # an N-process JAX job on this machine
  jaxcomp islands -n N -m M -- cmd ...   # elastic DiLoCo islands (torchft)
  jaxcomp lighthouse ...    # torchft's quorum service, for islands elsewhere
  jaxcomp autotune ...      # time the Pallas kernels against XLA on this GPU

``python -m jaxcomp.cli`` is the same command. Everything here runs from an
installed wheel; tooling that needs a source checkout (the device check, the
kernel benchmark) lives in the checkout's ``benchmarks/``.

Subcommands register themselves with :func:`register_subcommand`. To add one::

    def _add_mycmd(subparsers):
        p = subparsers.add_parser("mycmd", help="...")
        p.add_argument(...)
        p.set_defaults(func=_run_mycmd)   # _run_mycmd(args) -> exit code

    register_subcommand("mycmd", _add_mycmd)
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys
from typing import Any
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxcomp import compressors
from jaxcomp import kernels
from jaxcomp import launch
from jaxcomp import perfmodel
from jaxcomp.elastic import launcher as elastic_launcher

__all__ = ["main", "register_subcommand", "build_parser", "parse_compressor_spec",
           "autotune_rows", "autotune_table", "cache_entries", "simulated_tuner"]

_SUBCOMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {}


def register_subcommand(name: str, add_parser: Callable) -> None:
  """Registers ``add_parser(subparsers)``, which adds subcommand ``name``.

  The parser it adds must ``set_defaults(func=...)`` with ``func(args) -> int``.
  """
  if name in _SUBCOMMANDS:
    raise ValueError(f"subcommand {name!r} is already registered")
  _SUBCOMMANDS[name] = add_parser


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="jaxcomp", description="Gradient compression for JAX data-parallel training.")
  sub = parser.add_subparsers(dest="command", metavar="COMMAND")
  sub.required = True
  for add in _SUBCOMMANDS.values():
    add(sub)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of the ``jaxcomp`` console script; returns the exit code."""
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    return int(args.func(args) or 0)
  except (ValueError, FileNotFoundError, TypeError) as e:
    parser.exit(2, f"jaxcomp {args.command}: error: {e}\n")


# ---------------------------------------------------------------- whatif ---

DEFAULT_COMPRESSORS = ("bf16", "topk:ratio=0.01", "random_block:ratio=0.01", "qsgd:levels=16")


def _positive_float(what: str, unit: str):
  def parse(s: str) -> float:
    try:
      v = float(s)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{what} must be a number ({unit}), got {s!r}") from None
    if not (math.isfinite(v) and v > 0):
      raise argparse.ArgumentTypeError(f"{what} must be > 0 {unit}, got {s}")
    return v
  return parse


def _nonneg_float(what: str, unit: str):
  def parse(s: str) -> float:
    try:
      v = float(s)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{what} must be a number ({unit}), got {s!r}") from None
    if not (math.isfinite(v) and v >= 0):
      raise argparse.ArgumentTypeError(f"{what} must be >= 0 {unit}, got {s}")
    return v
  return parse


def _positive_int(what: str, meaning: str = ""):
  """An argparse type: an integer >= 1, or an error naming ``what``."""
  def parse(s: str) -> int:
    try:
      v = int(s)
    except ValueError:
      v = None
    if v is None or v < 1:
      raise argparse.ArgumentTypeError(
          f"{what} must be an integer >= 1{meaning}, got "
          f"{repr(s) if v is None else v}")
    return v
  return parse


_workers = _positive_int("workers")
_sync_every = _positive_int("--diloco-every", " (steps per sync)")


def parse_compressor_spec(spec: str) -> tuple[str, dict]:
  """``"topk:ratio=0.01,..."`` -> ``("topk", {"ratio": 0.01})``."""
  name, _, rest = spec.partition(":")
  kwargs = {}
  for item in filter(None, rest.split(",")):
    key, eq, value = item.partition("=")
    if not eq or not key:
      raise ValueError(f"bad compressor option {item!r} in {spec!r}; expected name:key=value,...")
    try:
      kwargs[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      kwargs[key] = value
  return name, kwargs


def _build_compressors(specs: Sequence[str]):
  out = {}
  for spec in specs:
    name, kwargs = parse_compressor_spec(spec)
    if name == "demo":  # jaxcomp.demo: an optimizer, priced by its exchange
      out[spec] = perfmodel.DeMoCompressor(**kwargs)
      continue
    out[spec] = compressors.get(name, **kwargs)
  return out


def _codecs(args, comps):
  if args.codec == "none":
    return {}, "encode/decode: not counted (--codec none)"
  if args.codec == "measure":
    codecs = {name: perfmodel.measure_codec(c) for name, c in comps.items()}
    dev = next(iter(codecs.values())).device if codecs else "-"
    return codecs, f"encode/decode: measured on this machine ({dev}), affine fit in size"
  if not os.path.isfile(args.codec):
    raise FileNotFoundError(f"codec file {args.codec!r} does not exist "
                            "(--codec takes 'measure', 'none' or a JSON file)")
  with open(args.codec) as f:
    d = json.load(f)
  missing = [n for n in comps if n not in d]
  if missing:
    raise ValueError(f"codec file {args.codec!r} has no entry for {missing}")
  return ({n: perfmodel.CodecCost.from_dict(d[n]) for n in comps},
          f"encode/decode: from {args.codec}")


def _network(args, workers=None):
  link = perfmodel.Link.from_bandwidth(args.bandwidth, args.latency * 1e-6)
  if args.algorithm == "hierarchical":
    intra = perfmodel.Link.from_bandwidth(args.intra_bandwidth, args.intra_latency * 1e-6)
    return perfmodel.Network(workers or args.workers, link, "hierarchical",
                             args.workers_per_node, intra)
  return perfmodel.Network(workers or args.workers, link)


def _buckets(s: str):
  if s in ("layer", "auto", "single", "mgwfbp"):
    return s
  try:
    mb = float(s)
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"--buckets takes layer, auto, single, mgwfbp or a bucket size in MB, "
        f"got {s!r}") from None
  if not mb > 0:
    raise argparse.ArgumentTypeError(f"bucket size must be > 0 MB, got {s}")
  return mb * 1e6


def _fmt_row(cells, widths):
  return "  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                   for i, (c, w) in enumerate(zip(cells, widths)))


def _print_table(header, rows, out):
  widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
  print(_fmt_row(header, widths), file=out)
  print("  ".join("-" * w for w in widths), file=out)
  for r in rows:
    print(_fmt_row(r, widths), file=out)


def _describe_network(args, network, overlap: str, output: str) -> str:
  """whatif's ``network:`` line: the cluster, buckets, overlap and layout."""
  return (f"network: {network.workers} workers, {args.bandwidth:g} Gbit/s, "
          f"{args.latency:g} us per message, {network.algorithm}"
          + (f" ({network.workers_per_node}/node, {args.intra_bandwidth:g} Gbit/s inside)"
             if network.algorithm == "hierarchical" else "")
          + f"; buckets {args.buckets if isinstance(args.buckets, str) else f'{args.buckets / 1e6:g} MB'}"
          + {"wfbp": "; overlap with backward (WFBP)",
             "after_backward": "; collectives after the backward pass",
             "serial": "; nothing overlaps (serial)"}[overlap]
          + (f"; compressors as DiLoCo, one exchange every {args.diloco_every} steps"
             if args.diloco_every > 1 else "")
          + {"mean": "", "shard": "; FSDP (float32 parameter gathers, compressed "
             "reduce-scatter)", "hsdp": "; HSDP (sharded inside a node, exact there; "
             "shards compressed across nodes)",
             "islands": "; DiLoCo islands (exact data parallelism inside a node, "
             "pseudo-gradients compressed across nodes; dense: data parallelism)",
             "islands_fsdp": "; DiLoCo islands with FSDP inside (each device's shard "
             "of the pseudo-gradient across nodes; dense: HSDP)"}[output]
          + (f"; tensor parallelism over {args.tensor_parallel} devices (each worker "
             f"exchanges its 1/{args.tensor_parallel} of every tensor; the tensor axis's "
             "activation collectives are not priced)" if args.tensor_parallel > 1 else ""))


def _print_simulation(profile, comps, network, kw, out) -> None:
  """whatif --simulate: the trace-based simulation from 4 to 2048 workers and
  where each compressor stops paying."""
  workers = [p for p in perfmodel.DEFAULT_WORKERS
             if network.algorithm == "ring" or p % network.workers_per_node == 0]
  sweep = perfmodel.sweep_workers(profile, comps, network, workers, **kw)
  print(f"\ntrace-based simulation, {workers[0]} to {workers[-1]} workers "
        "(speedup over dense; dense column: scaling factor)", file=out)
  names = list(comps)
  rows = [[str(p), f"{sweep[p]['dense'].scaling_factor:.3f}"]
          + [f"{sweep[p][n].speedup:.2f}" for n in names] for p in workers]
  _print_table(["workers", "dense_scaling"] + names, rows, out)
  for n in names:
    k = perfmodel.stops_paying(sweep, n)
    paid = [p for p in workers if sweep[p][n].speedup >= 1]
    if k is None:
      verdict = f"pays at every worker count from {workers[0]} to {workers[-1]}"
    elif not paid:
      verdict = "never pays in this range"
    else:
      verdict = f"stops paying at {k} workers"
      if any(p > k for p in paid):
        verdict += f" (pays again from {min(p for p in paid if p > k)})"
    print(f"  {n}: {verdict}", file=out)


def _run_whatif(args) -> int:
  """``jaxcomp whatif``: the predictions table (and --simulate, --plot)."""
  out = sys.stdout
  profile = perfmodel.load_profile(args.profile, tflops=args.tflops).tensor_parallel(
      args.tensor_parallel)
  network = _network(args)
  comps = _build_compressors(args.compressors)
  codecs, codec_note = _codecs(args, comps)
  overlap = "after_backward" if args.no_overlap else args.overlap
  collective = None if args.collective == "default" else args.collective
  output = {"replicated": "mean", "fsdp": "shard", "hsdp": "hsdp",
            "islands": "islands", "islands-fsdp": "islands_fsdp"}[args.sharding]
  if output not in ("mean", "shard") and network.algorithm != "hierarchical":
    raise ValueError(f"--sharding {args.sharding} groups the workers by node: pass "
                     "--algorithm hierarchical (and --workers-per-node)")
  if output in ("shard", "hsdp") and args.diloco_every > 1:
    raise ValueError(f"--diloco-every prices replicated DiLoCo or islands; drop "
                     f"--sharding {args.sharding}")
  kw: dict[str, Any] = dict(
      codecs=codecs, buckets=args.buckets, overlap=overlap, collective=collective,
      sync_every=args.diloco_every, output=output)
  res = perfmodel.compare(profile, comps, network, **kw)

  print(f"profile {profile.name}: {profile.num_params / 1e6:.1f}M parameters in "
        f"{len(profile.layer_sizes)} tensors; compute {profile.compute_time * 1e3:.1f} ms/step "
        f"({profile.meta.get('timing', 'measured')})", file=out)
  print(_describe_network(args, network, overlap, output), file=out)
  print(codec_note, file=out)
  print(file=out)
  rows = []
  for name, pr in res.items():
    rows.append([name, pr.collective, f"{pr.bytes_per_worker / 1e6:.2f}", f"{pr.step_time * 1e3:.1f}",
                 f"{pr.comm_time * 1e3:.1f}", f"{pr.exposed_comm * 1e3:.1f}",
                 f"{pr.codec_time * 1e3:.1f}", f"{pr.scaling_factor:.3f}", f"{pr.speedup:.2f}x"])
  _print_table(["compressor", "collective", "MB/worker", "step_ms", "comm_ms", "exposed_ms",
                "codec_ms", "scaling", "speedup"], rows, out)
  r = perfmodel.required_ratio(profile, network, target_scaling=args.target_scaling,
                               buckets=args.buckets, overlap=overlap)
  print(f"\nan ideal linear compressor (free encode/decode) needs ratio "
        f"{'>1e4 (start-up costs dominate)' if math.isinf(r) else f'{r:.2f}x'} "
        f"for scaling factor >= {args.target_scaling:g}", file=out)

  if args.simulate:
    _print_simulation(profile, comps, network, kw, out)

  if args.plot:
    _plot(args, profile, comps, network, kw)
    print(f"\nwrote {args.plot}", file=out)
  return 0


def _plot(args, profile, comps, network, kw):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  gbps = [0.1 * 10 ** (i / 8) for i in range(0, 30)]  # 0.1 .. ~560 Gbit/s
  sweep = perfmodel.sweep_bandwidth(profile, comps, network, gbps, **kw)
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name in comps:
    ax.plot(gbps, [sweep[g][name].speedup for g in gbps], label=name)
  ax.axhline(1.0, color="k", lw=0.8, ls="--", label="dense")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("bandwidth (Gbit/s)")
  ax.set_ylabel("predicted speedup over dense")
  ax.set_title(f"{profile.name}, {network.workers} workers, {args.latency:g} us latency")
  ax.legend(fontsize=8)
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(args.plot, dpi=110)
  plt.close(fig)


def _add_whatif(sub):
  p = sub.add_parser(
      "whatif", help="predict whether compression pays for a model and cluster",
      description="Predict step time, speedup over dense and scaling factor of compressors "
      "with the alpha-beta model of jaxcomp.perfmodel.")
  p.add_argument("--profile", default="resnet50",
                 help="built-in profile (resnet50, bert-base, gpt2-small) or a JSON file "
                 "saved by jaxcomp.perfmodel.save_profile (default: resnet50)")
  p.add_argument("--workers", "-p", type=_workers, default=16, help="data-parallel workers (default 16)")
  p.add_argument("--bandwidth", "-b", type=_positive_float("bandwidth", "Gbit/s"), default=10.0,
                 help="link bandwidth, Gbit/s (default 10)")
  p.add_argument("--latency", "-l", type=_nonneg_float("latency", "microseconds"), default=50.0,
                 help="start-up cost per message (alpha), microseconds (default 50)")
  p.add_argument("--algorithm", choices=("ring", "hierarchical"), default="ring")
  p.add_argument("--workers-per-node", type=_workers, default=8,
                 help="hierarchical: workers per node (default 8)")
  p.add_argument("--intra-bandwidth", type=_positive_float("intra-node bandwidth", "Gbit/s"),
                 default=1200.0, help="hierarchical: bandwidth inside a node, Gbit/s (default 1200)")
  p.add_argument("--intra-latency", type=_nonneg_float("intra-node latency", "microseconds"),
                 default=5.0, help="hierarchical: latency inside a node, microseconds (default 5)")
  p.add_argument("--compressors", "-c", nargs="+", default=list(DEFAULT_COMPRESSORS),
                 metavar="NAME[:K=V,...]",
                 help="compressors from jaxcomp.compressors, or demo[:compression_topk=K,"
                 "compression_chunk=C] (jaxcomp.demo's DCT top-k exchange, "
                 f"perfmodel.DeMoCompressor) (default: {' '.join(DEFAULT_COMPRESSORS)})")
  p.add_argument("--codec", default="measure",
                 help="encode/decode time: 'measure' (micro-benchmark on this device, default), "
                 "'none', or a JSON file {compressor spec: CodecCost fields}")
  p.add_argument("--buckets", type=_buckets, default="mgwfbp",
                 help="mgwfbp (default: the MG-WFBP merge plan for each compressor), layer, "
                 "auto (compressed_mean's default bucketing), single, or a bucket size in MB")
  p.add_argument("--overlap", choices=("wfbp", "after_backward", "serial"), default="wfbp",
                 help="wfbp (default): a bucket's collective overlaps the rest of the backward "
                      "pass; after_backward: collectives start after it; serial: nothing "
                      "overlaps (collectives run on the compute thread, as on XLA:CPU)")
  p.add_argument("--no-overlap", action="store_true",
                 help="the same as --overlap after_backward")
  p.add_argument("--collective", choices=("default", "allgather", "two_phase", "auto"),
                 default="default",
                 help="collective for the compressors that are not linear: default (what "
                      "jaxcomp.compressed_mean uses: auto for the quantizers, allgather for "
                      "the sparsifiers), allgather, two_phase or auto")
  p.add_argument("--diloco-every", type=_sync_every, default=1, metavar="H",
                 help="price the compressors as DiLoCo's pseudo-gradient exchange, "
                 "once every H steps (the dense baseline stays data parallel; "
                 "default 1: every step)")
  p.add_argument("--sharding", choices=("replicated", "fsdp", "hsdp", "islands",
                                        "islands-fsdp"), default="replicated",
                 help="replicated (default: data parallelism, every worker averages whole "
                 "gradients); fsdp (parameters sharded over all workers: float32 gathers "
                 "before the forward pass, the gradient reduce-scattered with each "
                 "compressor); hsdp (needs --algorithm hierarchical: sharded over a "
                 "node's workers, exact there, each shard averaged across nodes with "
                 "each compressor); islands (needs --algorithm hierarchical: DiLoCo "
                 "across nodes every --diloco-every steps, exact data parallelism "
                 "inside); islands-fsdp (the same with FSDP inside each node)")
  p.add_argument("--tensor-parallel", type=_positive_int("tensor-parallel degree"), default=1,
                 metavar="T",
                 help="tensor parallelism over T devices besides the data-parallel "
                 "--workers (FSDP x tensor with --sharding fsdp/hsdp, MaxText's mesh): "
                 "each worker holds, computes and exchanges 1/T of every tensor; the "
                 "tensor axis's activation collectives are not priced (default 1)")
  p.add_argument("--tflops", type=_positive_float("tflops", "TFLOP/s"), default=15.0,
                 help="built-in profiles: effective device TFLOP/s for compute times (default 15)")
  p.add_argument("--target-scaling", type=_positive_float("target scaling", ""), default=0.9,
                 help="scaling factor for the required-compression line (default 0.9)")
  p.add_argument("--simulate", action="store_true",
                 help="also simulate 4 to 2048 workers and say where each compressor stops paying")
  p.add_argument("--plot", metavar="PNG", help="write speedup against bandwidth to this PNG")
  p.set_defaults(func=_run_whatif)


register_subcommand("whatif", _add_whatif)


# -------------------------------------------------------------- autotune ---

AUTOTUNE_OPS = ("topk", "qsgd", "sign", "int8_block", "fp8_block")
AUTOTUNE_SIZES = (1 << 20, 1 << 24)
SIMULATED_SIZES = (4096,)


def _element_count(s: str) -> int:
  """An argparse type: an element count >= 1 (``1048576``, ``1e6``, ``2**20``)."""
  try:
    base, sep, exp = s.partition("**")
    v = int(base) ** int(exp) if sep else int(float(s))
  except (ValueError, OverflowError):
    v = None
  if v is None or v < 1:
    raise argparse.ArgumentTypeError(
        f"a size is an element count >= 1 (1048576, 1e6 or 2**20), got {s!r}")
  return v


def simulated_tuner(cache_path: str | None) -> kernels.Autotuner:
  """An :class:`jaxcomp.kernels.Autotuner` on a simulated GPU: the Pallas
  candidates run in interpret mode and both paths are timed for real (2
  trials of at most 2 calls), for trying autotuning off GPUs. Its table is
  keyed ``simulated GPU (<platform>, interpret)``, never a real GPU's."""
  return kernels.Autotuner(
      cache_path=cache_path, nvidia=True, interpret=True,
      device_kind=f"simulated GPU ({jax.devices()[0].platform}, interpret)",
      timer=lambda key, impl, fn, a: kernels.measure_seconds(
          fn, a, repeats=2, max_calls=2))


def autotune_rows(ops: Sequence[str], sizes: Sequence[int],
                  tuner: kernels.Autotuner) -> list[dict]:
  """Autotunes each compressor in ``ops`` (names for
  :func:`jaxcomp.compressors.get`) on its encode of a float32 vector of each
  element count in ``sizes``; every decision is read from ``tuner``'s cache
  file or measured and written there.

  Returns:
    One dict per decision: ``key``, ``from`` (``"<op> encode, n=<n>"``),
    ``source`` and :meth:`jaxcomp.kernels.Decision.to_json`'s fields
    (``implementation``, ``seconds`` per call of each path, ``errors``,
    ``n``, ``when``).
  """
  rows = []
  for name in ops:
    c = compressors.get(name)
    for n in sizes:
      for d in kernels.autotune(c.encode, jax.ShapeDtypeStruct((n,), jnp.float32),
                                jax.random.key(0), tuner=tuner):
        rows.append({"key": str(d.key), "from": f"{name} encode, n={n:,}",
                     **d.to_json(), "source": d.source})
  return rows


def cache_entries(path: str, table: str) -> list[tuple[str, dict]]:
  """The entries of ``table`` in the autotuning cache file at ``path``,
  sorted by key; none where the file is missing or unreadable."""
  try:
    with open(path, encoding="utf-8") as f:
      return sorted(json.load(f)["tables"].get(table, {}).items())
  except (OSError, ValueError, KeyError):
    return []


def autotune_table(rows: Sequence[dict]) -> str:
  """A markdown table of decisions (:func:`autotune_rows`' dicts, or cache
  entries with ``key`` and ``from``): the choice and milliseconds per call."""
  lines = ["| key | from | choice | pallas ms | xla ms | xla / pallas |",
           "| --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    s = r.get("seconds", {})
    p, x = s.get("pallas"), s.get("xla")
    fmt = lambda v: "failed" if v is None else f"{v * 1e3:.4f}"
    ratio = f"{x / p:.2f}" if p and x else ""
    lines.append(f"| {r['key']} | {r['from']} | {r['implementation']} | "
                 f"{fmt(p) if s else ''} | {fmt(x) if s else ''} | {ratio} |")
  return "\n".join(lines)


def _run_autotune(args) -> int:
  """``jaxcomp autotune``: tunes (or, with --show, reads) and prints the table."""
  tuner = simulated_tuner(args.cache) if args.simulate else kernels.Autotuner(
      cache_path=args.cache)
  path = tuner.cache_path
  if args.show:
    if path is None:
      raise ValueError("--show reads the cache file, and the cache is memory "
                       "only (--cache none or JAXCOMP_AUTOTUNE_CACHE=none)")
    rows = [{"key": key, "from": "cache file", **entry}
            for key, entry in cache_entries(path, tuner.table_name())]
  else:
    if not tuner.nvidia:
      print("not an NVIDIA GPU: implementation=None takes XLA here and nothing "
            "is timed (--simulate tries the command in interpret mode)")
    sizes = args.sizes or (SIMULATED_SIZES if args.simulate else AUTOTUNE_SIZES)
    rows = autotune_rows(args.ops, sizes, tuner)
  print(f"device: {tuner.device_kind}")
  print(f"cache: {path or 'none (memory only)'}, table {tuner.table_name()!r}")
  if rows:
    print(autotune_table(rows))
  elif args.show:
    print("the cache file has no entries for this device and these versions "
          "(jaxcomp autotune fills it)")
  else:
    print("no decisions: nothing is tuned off NVIDIA GPUs")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"device": tuner.device_kind, "table": tuner.table_name(),
                 "decisions": rows}, f, indent=1)
    print(f"wrote {args.json}")
  return 0


def _add_autotune(sub):
  p = sub.add_parser(
      "autotune", help="time the Pallas kernels against XLA on this GPU and "
      "keep the faster in the autotuning cache",
      description="Autotune the kernel compressors' encodes on this machine's "
      "NVIDIA GPU: for each op and size, time the Pallas and the XLA path, "
      "keep the faster in the cache file that implementation=None reads "
      "(jaxcomp.kernels.Autotuner; one table per GPU kind and JAX, jaxlib and "
      "jaxcomp version), and print the decisions. Keys already in the cache "
      "are read, not timed again. Off NVIDIA GPUs XLA is taken and nothing is "
      "timed.")
  p.add_argument("--ops", nargs="+", choices=AUTOTUNE_OPS, default=list(AUTOTUNE_OPS),
                 help=f"compressors whose encode is tuned (default: {' '.join(AUTOTUNE_OPS)})")
  p.add_argument("--sizes", nargs="+", type=_element_count, default=None, metavar="N",
                 help="float32 element counts, e.g. 1e6 or 2**20; each tunes its size "
                 "class (2**(c-1) < n <= 2**c) (default: 2**20 2**24; 4096 with --simulate)")
  p.add_argument("--cache", default=None, metavar="PATH",
                 help="the cache file (default: $JAXCOMP_AUTOTUNE_CACHE, else "
                 "$XDG_CACHE_HOME/jaxcomp/autotune.json or ~/.cache/jaxcomp/autotune.json; "
                 "'none': memory only)")
  p.add_argument("--show", action="store_true",
                 help="print the cache file's table for this GPU and these versions; "
                 "time nothing")
  p.add_argument("--json", metavar="PATH", help="also write the decisions here")
  p.add_argument("--simulate", action="store_true",
                 help="a simulated GPU: the Pallas kernels in interpret mode, timed for "
                 "real at small sizes (to try the command off GPUs; its own cache table)")
  p.set_defaults(func=_run_autotune)


register_subcommand("launch", launch.add_launch_command)
register_subcommand("islands", elastic_launcher.add_islands_command)
register_subcommand("lighthouse", elastic_launcher.add_lighthouse_command)
register_subcommand("autotune", _add_autotune)


if __name__ == "__main__":
  sys.exit(main())
