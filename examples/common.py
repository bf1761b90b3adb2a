"""What the examples share: the compression flags, the mapping from a
config to a compressor's hyperparameters, and the traffic report.

Importing this module does not import jax (set XLA flags first, see
:mod:`examples.xla_flags`).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

# Config fields that may be compressor hyperparameters, by the name the
# compressor takes (the threshold compressor's capacity follows --ratio).
_HYPERPARAMETER_FIELDS = {
    "ratio": "ratio", "levels": "levels", "rank": "rank", "bits": "bits",
    "format": "format", "threshold": "threshold", "block_size": "block_size",
    "capacity_ratio": "ratio", "rounding": "rounding",
    "value_bits": "value_bits", "topk": "topk", "chunk": "chunk",
}
_ERROR_FEEDBACK = {"auto": None, "on": True, "off": False}


@dataclasses.dataclass
class CompressionConfig:
  """The compression fields every example's Config has (its config module
  may override a default, e.g. PowerSGD's rank)."""

  compressor: str = "topk"  # a name from jaxcomp.compressors.names()
  ratio: float = 0.01  # fraction of entries sent (top-k, random-block, ...)
  levels: int = 7  # QSGD levels
  rank: int = 4  # PowerSGD rank
  bits: int = 8  # int8_block bits (2, 4 or 8)
  format: str = "e4m3"  # fp8_block format
  threshold: float = 1e-3  # threshold compressor's magnitude threshold
  block_size: int = 256  # int8_block / fp8_block elements per scale
  rounding: str = "nearest"  # int8_block / fp8_block: or "stochastic" (unbiased)
  value_bits: int | None = None  # top-k: quantize the kept values (2, 4 or 8)
  error_feedback: bool | str | None = None  # None: on for biased ones
  error_feedback_decay: float | None = None  # residual error feedback with
  #                                            this decay (SparseLoCo: 0.95)
  collective: str | None = None  # None: the compressor's default
  #                                ("sender_mean": SparseLoCo's reference)
  topk: int = 64  # chunked_topk / dct_topk: entries kept per chunk of
  chunk: int = 64  # chunk x chunk elements (SparseLoCo: 64 of 64 x 64)
  min_compress_size: int = 0  # smaller tensors: exact all-reduce
  # One bucket per tensor: what the figures in docs/convergence.md and
  # docs/compressor_results.md were measured with (the library's default,
  # "auto", packs small tensors together; --bucketing auto).
  bucketing: str = "layerwise"
  ratio_warmup_steps: int = 0  # DGC sparsity warm-up stage length (0: none)
  optimizer: str = "adam"  # one of OPTIMIZERS, after the compressed mean,
  #                          or one of COMPRESSED_OPTIMIZERS in its place
  freeze_step: int = 500  # onebit_adam / onebit_lamb: dense warm-up steps;
  #                         zero_one_adam: its var_freeze_step
  var_update_scaler: int = 16  # zero_one_adam (the paper's kappa)
  local_step_scaler: int = 32678  # zero_one_adam: frozen steps per local
  local_step_clipper: int = 16  # interval, and the longest interval (H)
  seed: int = 0
  max_steps: int | None = None  # stop early (tests)
  progress: bool = True


def add_compression_flags(p: argparse.ArgumentParser, defaults) -> None:
  """Adds --compressor and its hyperparameter flags, --error-feedback, and
  the run flags every example has (--devices, --seed, --max-steps,
  --no-progress), with ``defaults`` (the example's ``config.Config()``) as
  their defaults: the config module is the one place they are set."""
  d = defaults
  ef = {v: k for k, v in _ERROR_FEEDBACK.items()}.get(d.error_feedback,
                                                     d.error_feedback)
  p.add_argument("--compressor", default=d.compressor,
                 help="compressor name (see jaxcomp.compressors.names())")
  p.add_argument("--ratio", type=float, default=d.ratio,
                 help="fraction sent by top-k / random-block / random-k / "
                 "DGC (and the threshold compressor's capacity)")
  p.add_argument("--levels", type=int, default=d.levels, help="QSGD levels")
  p.add_argument("--rank", type=int, default=d.rank, help="PowerSGD rank")
  p.add_argument("--bits", type=int, default=d.bits, help="int8_block bits")
  p.add_argument("--format", default=d.format, help="fp8_block format")
  p.add_argument("--threshold", type=float, default=d.threshold,
                 help="threshold compressor's magnitude threshold")
  p.add_argument("--block-size", type=int, default=d.block_size,
                 help="int8_block / fp8_block elements per scale")
  p.add_argument("--value-bits", type=int, choices=(2, 4, 8), default=d.value_bits,
                 help="top-k: send the kept values as this many bits (SparseLoCo: 2)")
  p.add_argument("--topk", type=int, default=d.topk,
                 help="chunked_topk / dct_topk: entries kept per chunk")
  p.add_argument("--chunk", type=int, default=d.chunk,
                 help="chunked_topk / dct_topk: chunks of up to chunk x chunk "
                 "elements")
  p.add_argument("--rounding", choices=("nearest", "stochastic"),
                 default=d.rounding,
                 help="int8_block / fp8_block rounding (stochastic: unbiased, "
                 "no error feedback by default)")
  p.add_argument("--error-feedback", choices=[*_ERROR_FEEDBACK, "ef21", "dgc"],
                 default=ef, help="auto: on for biased compressors")
  p.add_argument("--error-feedback-decay", type=float,
                 default=d.error_feedback_decay,
                 help="residual error feedback that keeps this fraction of "
                 "what it holds back (SparseLoCo: 0.95)")
  p.add_argument("--collective", default=d.collective,
                 help="the collective (default: the compressor's; "
                 "sender_mean: each coordinate averaged over the devices "
                 "that sent it)")
  p.add_argument("--ratio-warmup-steps", type=int,
                 default=d.ratio_warmup_steps,
                 help="DGC's sparsity warm-up: stages of this many steps at "
                 "ratio 25%%, 6.25%%, ... down to --ratio, each its own "
                 "compiled step (0: none)")
  p.add_argument("--min-compress-size", type=int, default=d.min_compress_size,
                 help="tensors with fewer elements go through an exact "
                 "all-reduce (biases, norms)")
  p.add_argument("--bucketing", default=d.bucketing,
                 choices=("layerwise", "auto", "whole"),
                 help="which tensors are compressed together: one bucket per "
                 "tensor (layerwise), small ones packed (auto, the library's "
                 "default), or the whole model")
  p.add_argument("--devices", type=int, default=8,
                 help="simulated CPU devices (ignored on GPU/TPU)")
  p.add_argument("--seed", type=int, default=d.seed)
  p.add_argument("--max-steps", type=int, default=d.max_steps)
  p.add_argument("--no-progress", action="store_true")


def add_run_flags(p: argparse.ArgumentParser, defaults, names) -> None:
  """Adds ``--name`` flags for the Config fields ``names`` (their type and
  default from ``defaults``; ``name_with_underscores`` as
  ``--name-with-dashes``)."""
  for name in names:
    value = getattr(defaults, name)
    kind = type(value) if value is not None else str
    p.add_argument("--" + name.replace("_", "-"), type=kind, default=value)


OPTIMIZERS = ("adam", "momentum", "sgd", "muon", "demo")
# DeepSpeed's compressed optimizers (jaxcomp.optimizers): each replaces
# both the compressed mean and the optimizer after it.
COMPRESSED_OPTIMIZERS = ("onebit_adam", "zero_one_adam", "onebit_lamb")
LR_SCHEDULES = ("constant", "cosine")  # char_lm's, after its warm-up


def optimizer(name: str, learning_rate, muon_dimensions=None):
  """The examples' optimizer after the compressed mean: ``"adam"``,
  ``"momentum"`` (SGD with Nesterov momentum 0.9, the optimizer of the
  PowerSGD and DGC papers), ``"sgd"`` (plain SGD: for
  ``error_feedback="dgc"``, whose momentum correction keeps the momentum
  before the exchange) or ``"muon"`` (``optax.contrib.muon``: Muon on the
  matrices ``muon_dimensions`` names, Adam on the rest, with Moonlight's
  update scaling ``consistent_rms=0.2`` so that one learning rate suits
  both; MuLoCo's inner optimizer). ``"demo"`` (:func:`jaxcomp.demo`) is
  handled by :func:`stages`, as it replaces the compressed mean too.

  Args:
    name: one of :data:`OPTIMIZERS`.
    learning_rate: a number or an optax schedule.
    muon_dimensions: ``"muon"`` only: ``optax.contrib.muon``'s
      ``muon_weight_dimension_numbers`` (a callable of the parameters, e.g.
      ``examples.char_lm.model.muon_dimensions``); None: Muon on every 2-D
      parameter.

  Raises:
    ValueError: another name.
  """
  import optax
  if name == "adam":
    return optax.adam(learning_rate)
  if name == "momentum":
    return optax.sgd(learning_rate, momentum=0.9, nesterov=True)
  if name == "sgd":
    return optax.sgd(learning_rate)
  if name == "muon":
    return optax.contrib.muon(learning_rate, consistent_rms=0.2,
                              muon_weight_dimension_numbers=muon_dimensions)
  if name == "demo":
    raise ValueError("optimizer 'demo' (jaxcomp.demo) exchanges its own "
                     "momentum components: it replaces the compressed mean, "
                     "not the optimizer after it (see stages())")
  raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def compressed_optimizer(config, learning_rate):
  """``config.optimizer`` (one of :data:`COMPRESSED_OPTIMIZERS`) over
  ``"data"``, with ``config``'s freeze step (and 0/1 Adam's interval
  settings) and ``learning_rate`` (a number or an optax schedule).

  Raises:
    ValueError: another name.
  """
  import jaxcomp
  name = config.optimizer
  if name == "onebit_adam":
    return jaxcomp.onebit_adam(learning_rate, axis_name="data",
                               freeze_step=config.freeze_step)
  if name == "onebit_lamb":
    return jaxcomp.onebit_lamb(learning_rate, axis_name="data",
                               freeze_step=config.freeze_step)
  if name == "zero_one_adam":
    return jaxcomp.zero_one_adam(
        learning_rate, axis_name="data", var_freeze_step=config.freeze_step,
        var_update_scaler=config.var_update_scaler,
        local_step_scaler=config.local_step_scaler,
        local_step_clipper=config.local_step_clipper)
  raise ValueError(f"compressed optimizer must be one of "
                   f"{COMPRESSED_OPTIMIZERS}, got {name!r}")


def exchange_name(args: argparse.Namespace) -> str:
  """What the run's exchange is called in its first output line."""
  if getattr(args, "optimizer", None) == "demo":
    return "none (DeMo sends its own DCT top-k momentum components)"
  if getattr(args, "optimizer", None) in COMPRESSED_OPTIMIZERS:
    return f"none ({args.optimizer} sends its own 1-bit momentum)"
  return args.compressor


def compression_config(args: argparse.Namespace) -> dict[str, Any]:
  """The Config fields that :func:`add_compression_flags` sets."""
  return dict(
      compressor=args.compressor, ratio=args.ratio, levels=args.levels,
      rank=args.rank, bits=args.bits, format=args.format,
      threshold=args.threshold, block_size=args.block_size,
      rounding=args.rounding, value_bits=args.value_bits,
      error_feedback=_ERROR_FEEDBACK.get(args.error_feedback,
                                         args.error_feedback),
      error_feedback_decay=args.error_feedback_decay,
      collective=args.collective, topk=args.topk, chunk=args.chunk,
      min_compress_size=args.min_compress_size, bucketing=args.bucketing,
      ratio_warmup_steps=args.ratio_warmup_steps,
      seed=args.seed, max_steps=args.max_steps,
      progress=not args.no_progress)


def compressor_kwargs(config) -> dict[str, Any]:
  """The config's hyperparameters that ``config.compressor`` takes.

  Raises:
    ValueError: unknown compressor name.
  """
  import jaxcomp
  taken = jaxcomp.compressors.hyperparameters(config.compressor)
  return {name: getattr(config, field)
          for name, field in _HYPERPARAMETER_FIELDS.items() if name in taken}


def error_feedback(config):
  """The ``error_feedback`` argument of the config: its
  ``error_feedback`` (a name, True, False or None), or with
  ``error_feedback_decay`` set, residual error feedback with that decay
  (:class:`jaxcomp.feedback.ResidualFeedback`).

  Raises:
    ValueError: a decay with error feedback off or another scheme, or a
      decay outside [0, 1].
  """
  decay = getattr(config, "error_feedback_decay", None)
  if decay is None:
    return config.error_feedback
  if config.error_feedback not in (None, True, "residual"):
    raise ValueError(f"error_feedback_decay={decay} is residual error "
                     "feedback's decay; it needs error_feedback 'auto' or "
                     f"'on', not {config.error_feedback!r}")
  import jaxcomp
  return jaxcomp.feedback.ResidualFeedback(decay=decay)


def stages(config, learning_rate, muon_dimensions=None):
  """The run's transformations, as :func:`jaxcomp.sparsity_warmup` stages.

  Each is the compressed mean over ``"data"`` (``config``'s compressor,
  hyperparameters, error feedback, ``min_compress_size``, seed) chained with
  ``config.optimizer``. Without ``config.ratio_warmup_steps``: one stage
  from step 0. With it, DGC's sparsity warm-up: ``ratio`` 0.25 for that many
  steps, then 0.0625, ... down to ``config.ratio``, each stage its own
  transformation and compiled step, sending its own payload.

  ``muon_dimensions`` goes to :func:`optimizer` (``"muon"``).

  Raises:
    ValueError: an unknown compressor, ``ratio_warmup_steps`` < 0, or > 0
      with a compressor that takes no ``ratio``.
  """
  import jaxcomp
  import optax
  kwargs = compressor_kwargs(config)
  feedback = error_feedback(config)
  collective = getattr(config, "collective", None)
  inner = lambda: optimizer(config.optimizer, learning_rate, muon_dimensions)

  # FSDP runs (char_lm's --sharding fsdp) reduce-scatter into shards; HSDP
  # runs reduce-scatter exactly over a host's devices, then average each
  # shard across hosts with the compressor.
  sharding = getattr(config, "sharding", "replicated")
  output = "shard" if sharding == "fsdp" else "mean"
  axis = "hosts" if sharding == "hsdp" else "data"

  bucketing = getattr(config, "bucketing", "layerwise")
  diloco_every = getattr(config, "diloco_every", 0)
  fragments = getattr(config, "diloco_fragments", 1)

  def make_tx(ratio=None):
    kw = kwargs if ratio is None else dict(kwargs, ratio=ratio)
    if config.optimizer == "demo":
      # DeMo: a whole optimizer that sends its own DCT top-k components
      # (the compressor flags do not apply).
      return jaxcomp.demo(learning_rate)
    if config.optimizer in COMPRESSED_OPTIMIZERS:
      # 1-bit Adam, 0/1 Adam, 1-bit LAMB: dense warm-up, then their own
      # 1-bit exchange of the momentum (the compressor flags do not apply).
      return compressed_optimizer(config, learning_rate)
    if diloco_every:
      # DiLoCo (char_lm's --diloco-every): the optimizer runs per device,
      # the compressed mean carries the pseudo-gradient every H steps.
      mom = getattr(config, "diloco_outer_momentum", 0.9)
      outer = optax.sgd(getattr(config, "diloco_outer_lr", 0.7),
                        momentum=mom or None, nesterov=bool(mom))
      return jaxcomp.diloco(
          inner(), outer,
          sync_every=diloco_every,
          fragments=fragments,
          compressor=config.compressor,
          min_compress_size=config.min_compress_size, bucketing=bucketing,
          error_feedback=feedback, collective=collective, seed=config.seed,
          **kw)
    inside = ([jaxcomp.compressed_mean("identity", "devices", output="shard")]
              if sharding == "hsdp" else [])
    return optax.chain(
        *inside,
        jaxcomp.compressed_mean(config.compressor, axis,
                                min_compress_size=config.min_compress_size,
                                bucketing=bucketing,
                                error_feedback=feedback, collective=collective,
                                seed=config.seed, output=output, **kw),
        inner())

  if config.ratio_warmup_steps < 0:
    raise ValueError("ratio_warmup_steps must be >= 0, got "
                     f"{config.ratio_warmup_steps}")
  if not config.ratio_warmup_steps:
    return [jaxcomp.compressors.WarmupStage(0, kwargs.get("ratio"),
                                            make_tx())]
  if "ratio" not in kwargs:
    raise ValueError(f"ratio_warmup_steps needs a compressor that takes a "
                     f"ratio (topk, dgc, random_block, ...), not "
                     f"{config.compressor!r}; set it to 0")
  return jaxcomp.sparsity_warmup(make_tx, config.ratio,
                                 config.ratio_warmup_steps)


def stage_bytes(stages, params, mesh, sharding: str = "replicated"):
  """Bytes one device sends per step in each stage (its transformation's
  statistics, :func:`exchange_stats`), for
  :func:`jaxcomp.compressors.bytes_over`; ``sharding``: ``"replicated"``,
  ``"fsdp"`` (the stages reduce-scatter into flat shards of ``params``),
  ``"hsdp"`` (into a host's shards; the bytes are those sent across
  hosts) or ``"diloco"`` (each device's own copy, the bytes of one
  sync)."""
  import jaxcomp
  layout, axis_name = {
      "replicated": (jaxcomp.DataParallel(), "data"),
      "diloco": (jaxcomp.Islands(), "data"),
      "fsdp": (jaxcomp.FSDP(), "data"),
      "hsdp": (jaxcomp.FSDP(shard_axis="devices"), ("hosts", "devices")),
  }[sharding]
  return [float(exchange_stats(jaxcomp.init(s.tx, params, mesh, layout=layout,
                                            axis_name=axis_name).opt_state,
                               sharding).bytes_sent) for s in stages]


def exchange_stats(opt_state, sharding: str = "replicated"):
  """The statistics of the exchange a run compresses: its one exchange, or
  with ``sharding="hsdp"`` the one across hosts (the exact reduce-scatter
  inside a host, an exchange of its own, is not compressed)."""
  import jaxcomp
  if sharding == "hsdp":
    return jaxcomp.get_stats(opt_state, by_exchange=True)["hosts"]
  return jaxcomp.get_stats(opt_state)


def print_traffic(result: dict[str, Any]) -> None:
  """Prints the bytes each device sends per step, from the transform's
  statistics (operand bytes, and the wire bytes of the ring algorithms)
  and from the collectives of the lowered step (on CPU, XLA's backend
  later widens bf16 all-reduces to float32; GPUs keep bf16). A compression
  factor is dense bytes over compressed bytes."""
  print(f"bytes sent per device per step: {result['bytes_per_step']:.0f} "
        f"(dense {result['dense_bytes_per_step']:.0f}, compression "
        f"{result['compression']:.1f}x; on the wire "
        f"{result['wire_bytes_per_step']:.0f}, compression "
        f"{result['wire_compression']:.1f}x)")
  total = result.get("total_bytes")
  if total is not None and total != result["bytes_per_step"] * result["steps"]:
    dense_total = result["dense_bytes_per_step"] * result["steps"]
    print(f"bytes sent per device over the run, warm-up included: "
          f"{total:.0f} (dense {dense_total:.0f}, compression "
          f"{dense_total / total:.1f}x)")
  dense = result.get("hlo_dense_operand_bytes")
  print(f"collective operand bytes per device per step in the step's HLO "
        f"(lowered, before backend passes): {result['hlo_operand_bytes']}"
        + (f" (dense {dense})" if dense is not None else ""))
