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
import math
import sys
from typing import Any
from collections.abc import Callable, Sequence

from jaxcomp import compressors
from jaxcomp import autotune
from jaxcomp import launch
from jaxcomp import perfmodel
from jaxcomp.elastic import launcher as elastic_launcher
from jaxcomp.perfmodel import verdict as whatif

__all__ = ["main", "register_subcommand", "build_parser", "parse_compressor_spec"]

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
    if name in perfmodel.OPTIMIZERS:  # 1-bit Adam, 0/1 Adam, 1-bit LAMB
      out[spec] = perfmodel.CompressedOptimizer(name, **kwargs)
      continue
    out[spec] = compressors.get(name, **kwargs)
  return out


def _codecs(args, comps, target):
  codecs, lines = whatif.codec_costs(args.codec, comps, target)
  return codecs, "\n".join(lines)


class _Given(argparse.Action):
  """Stores the value and records that the user gave the option (``args.given``)."""

  def __call__(self, parser, namespace, values, option_string=None):
    setattr(namespace, self.dest, values)
    namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


def _links(args, device) -> dict[str, str]:
  """Applies ``--network`` and the device's NVLink where the user gave no
  number, and says where each link figure comes from."""
  given = getattr(args, "given", frozenset())
  src = {k: "given" if k in given else "assumed default"
         for k in ("bandwidth", "latency", "workers", "intra_bandwidth")}
  if args.network is not None:
    net = perfmodel.network_preset(args.network)
    for k, v in (("bandwidth", net.gbps), ("latency", net.latency_us)):
      if k not in given:
        setattr(args, k, v)
        src[k] = (f"{net.name}: {net.source}" if k == "bandwidth"
                  else f"assumed for {net.description}")
  if device is not None and "intra_bandwidth" not in given:
    args.intra_bandwidth = device.intra_gbps
    src["intra_bandwidth"] = f"{device.name} NVLink, {device.label}"
  return src


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


def _describe_network(args, network, overlap: str, output: str,
                      sources: dict[str, str]) -> str:
  """whatif's ``network:`` line: the cluster, buckets, overlap and layout,
  each link figure with where it comes from (``sources``, :func:`_links`)."""
  return (f"network: {network.workers} workers ({sources['workers']}), {args.bandwidth:g} "
          f"Gbit/s ({sources['bandwidth']}), {args.latency:g} us per message "
          f"({sources['latency']}), {network.algorithm}"
          + (f" ({network.workers_per_node}/node, {args.intra_bandwidth:g} Gbit/s inside: "
             f"{sources['intra_bandwidth']})"
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


def _whatif_profile(args):
  """whatif's profile, target device (and where it comes from), and the
  link figures' sources; applies the presets to ``args``."""
  device = (None if args.device is None else perfmodel.device_preset(args.device))
  profile = whatif.whatif_profile(
      profile=args.profile, model=args.model, params=args.params, layers=args.layers,
      d_model=args.d_model, vocab=args.vocab, seq_len=args.seq_len,
      tokens_per_step=args.tokens_per_step, device=device, mfu=args.mfu,
      tflops=args.tflops).tensor_parallel(args.tensor_parallel)
  target, target_from = whatif.target_device(args.device, profile)
  return profile, target, target_from, _links(args, target)


def _print_break_even(profile, comps, network, kw, res, args, out) -> dict:
  """Each compressor's break-even bandwidth; returns :func:`whatif.verdicts`'."""
  _, verdicts = whatif.verdicts(profile, comps, network, **kw)
  print("\nbreak-even bandwidth (derived: where the predicted speedup over dense crosses "
        "1, the rest held)", file=out)
  for name in comps:
    print(whatif.break_even_line(name, verdicts[name], args.bandwidth, res[name].speedup),
          file=out)
  return verdicts


def _run_whatif(args) -> int:
  """``jaxcomp whatif``: the predictions table (and --simulate, --plot)."""
  out = sys.stdout
  profile, target, target_from, sources = _whatif_profile(args)
  network = _network(args)
  comps = _build_compressors(args.compressors)
  codecs, codec_note = _codecs(args, comps, target)
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
        f"{len(profile.layer_sizes)} tensors ({profile.meta.get('sizes', 'given')})\n"
        f"  compute {profile.compute_time * 1e3:.1f} ms/step ({whatif.profile_label(profile)})",
        file=out)
  shards = {"fsdp": network.workers, "hsdp": network.workers_per_node,
            "islands-fsdp": network.workers_per_node}.get(args.sharding, 1)
  print(whatif.device_line(target, target_from, profile, shards=shards), file=out)
  print(_describe_network(args, network, overlap, output, sources), file=out)
  print(codec_note, file=out)
  print("\npredicted (derived: the alpha-beta model of jaxcomp.perfmodel from the figures "
        "above)", file=out)
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
        f"for scaling factor >= {args.target_scaling:g} (derived)", file=out)
  verdicts = _print_break_even(profile, comps, network, kw, res, args, out)

  if args.simulate:
    _print_simulation(profile, comps, network, kw, out)

  if args.plot:
    _plot(args, profile, comps, network, dict(kw, verdicts=verdicts))
    print(f"\nwrote {args.plot}", file=out)
  return 0


def _plot(args, profile, comps, network, kw):
  kw = dict(kw)
  verdicts = kw.pop("verdicts", None)
  sweep, _ = whatif.verdicts(profile, comps, network, gbps=whatif.BANDWIDTHS, **kw)
  where = f" on {args.device}" if args.device else ""
  whatif.plot_speedup(
      args.plot, sweep, list(comps), gbps=args.bandwidth, verdicts=verdicts,
      title=f"{profile.name}{where}, {network.workers} workers, {args.latency:g} us latency")


def _add_target_args(p):
  """whatif's options that name the model, device and network by preset."""
  p.add_argument("--model", default=None, metavar="NAME",
                 help="a decoder-only transformer by configuration: "
                 f"{', '.join(perfmodel.DECODERS)} (needs --device)")
  p.add_argument("--params", type=_positive_float("--params", "parameters"), default=None,
                 metavar="N", help="a Llama-style decoder of about N parameters (e.g. 1.1e9; "
                 "needs --device; --layers / --d-model / --vocab derived unless given)")
  p.add_argument("--layers", type=_positive_int("--layers"), default=None)
  p.add_argument("--d-model", type=_positive_int("--d-model"), default=None)
  p.add_argument("--vocab", type=_positive_int("--vocab"), default=None,
                 help="--params: vocabulary size (default 128256, Llama 3's)")
  p.add_argument("--seq-len", type=_positive_int("--seq-len"), default=None,
                 help="--model / --params: sequence length (default: the model's; 8192 "
                 "for Llama 3, 1024 for GPT-2)")
  p.add_argument("--tokens-per-step", type=_positive_int("--tokens-per-step"), default=None,
                 help="--model / --params: tokens each worker processes per step "
                 "(default 8192, assumed)")
  p.add_argument("--device", choices=tuple(perfmodel.DEVICES), default=None,
                 help="the device each worker is: its peak FLOP/s for --model, --params and "
                 "the built-in profiles, its NVLink for --algorithm hierarchical, its kernel "
                 "table for --codec auto (default: the device a --profile file records)")
  p.add_argument("--mfu", type=_positive_float("--mfu", ""), default=None,
                 help="model FLOP utilization with --device, in (0, 1] (default 0.4, assumed)")
  p.add_argument("--network", choices=tuple(perfmodel.NETWORKS), default=None,
                 help="a link preset: its bandwidth and latency, unless -b / -l are given")


def _add_whatif(sub):
  p = sub.add_parser(
      "whatif", help="predict whether compression pays for a model and cluster",
      description="Predict step time, speedup over dense and scaling factor of compressors "
      "with the alpha-beta model of jaxcomp.perfmodel.")
  p.add_argument("--profile", default=None,
                 help="built-in profile (resnet50, resnet18-cifar, bert-base, gpt2-small) or a JSON file "
                 "saved by jaxcomp.perfmodel.save_profile (default: resnet50)")
  _add_target_args(p)
  p.add_argument("--workers", "-p", type=_workers, default=16, action=_Given,
                 help="data-parallel workers (default 16)")
  p.add_argument("--bandwidth", "-b", type=_positive_float("bandwidth", "Gbit/s"), default=10.0,
                 action=_Given, help="link bandwidth, Gbit/s (default 10)")
  p.add_argument("--latency", "-l", type=_nonneg_float("latency", "microseconds"), default=50.0,
                 action=_Given,
                 help="start-up cost per message (alpha), microseconds (default 50)")
  p.add_argument("--algorithm", choices=("ring", "hierarchical"), default="ring")
  p.add_argument("--workers-per-node", type=_workers, default=8,
                 help="hierarchical: workers per node (default 8)")
  p.add_argument("--intra-bandwidth", type=_positive_float("intra-node bandwidth", "Gbit/s"),
                 default=1200.0, action=_Given,
                 help="hierarchical: bandwidth inside a node, Gbit/s (default: the --device's "
                 "NVLink, else 1200)")
  p.add_argument("--intra-latency", type=_nonneg_float("intra-node latency", "microseconds"),
                 default=5.0, help="hierarchical: latency inside a node, microseconds (default 5)")
  p.add_argument("--compressors", "-c", nargs="+", default=list(DEFAULT_COMPRESSORS),
                 metavar="NAME[:K=V,...]",
                 help="compressors from jaxcomp.compressors, or demo[:compression_topk=K,"
                 "compression_chunk=C] (jaxcomp.demo's DCT top-k exchange, "
                 f"perfmodel.DeMoCompressor) (default: {' '.join(DEFAULT_COMPRESSORS)})")
  p.add_argument("--codec", default="auto",
                 help="encode/decode time: 'auto' (default: a GPU --device from the kernel "
                 "tables shipped in jaxcomp.perfmodel.kernel_table, scaled by memory "
                 "bandwidth; cpu timed here; no device: not counted), 'measure' (timed on "
                 "the device at hand; refused when --device names another), 'none', or a "
                 "JSON file {compressor spec: CodecCost fields}")
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
  p.add_argument("--tflops", type=_positive_float("tflops", "TFLOP/s"), default=None,
                 help="built-in profiles: effective device TFLOP/s for compute times "
                 "(default: the --device's peak x --mfu, else 15, assumed)")
  p.add_argument("--target-scaling", type=_positive_float("target scaling", ""), default=0.9,
                 help="scaling factor for the required-compression line (default 0.9)")
  p.add_argument("--simulate", action="store_true",
                 help="also simulate 4 to 2048 workers and say where each compressor stops paying")
  p.add_argument("--plot", metavar="PNG",
                 help="write speedup against bandwidth to this PNG, your -b marked")
  p.set_defaults(func=_run_whatif)


register_subcommand("whatif", _add_whatif)


register_subcommand("launch", launch.add_launch_command)
register_subcommand("islands", elastic_launcher.add_islands_command)
register_subcommand("lighthouse", elastic_launcher.add_lighthouse_command)
register_subcommand("autotune", autotune.add_autotune_command)


if __name__ == "__main__":
  sys.exit(main())
