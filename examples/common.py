"""What the examples share: the compression flags, the mapping from a
config to a compressor's hyperparameters, and the traffic report.

Importing this module does not import jax (set XLA flags first, see
:mod:`examples.xla_flags`).
"""

from __future__ import annotations

import argparse
from typing import Any

# Config fields that may be compressor hyperparameters, by the name the
# compressor takes (the threshold compressor's capacity follows --ratio).
_HYPERPARAMETER_FIELDS = {
    "ratio": "ratio", "levels": "levels", "rank": "rank", "bits": "bits",
    "format": "format", "threshold": "threshold", "block_size": "block_size",
    "capacity_ratio": "ratio",
}
_ERROR_FEEDBACK = {"auto": None, "on": True, "off": False}


def add_compression_flags(p: argparse.ArgumentParser, *,
                          rank: int = 4) -> None:
  """Adds --compressor and its hyperparameter flags, --error-feedback, and
  the run flags every example has (--devices, --seed, --max-steps,
  --no-progress)."""
  p.add_argument("--compressor", default="topk",
                 help="compressor name (see jaxcomp.compressors.names())")
  p.add_argument("--ratio", type=float, default=0.01,
                 help="fraction sent by top-k / random-block / random-k / "
                 "DGC (and the threshold compressor's capacity)")
  p.add_argument("--levels", type=int, default=7, help="QSGD levels")
  p.add_argument("--rank", type=int, default=rank, help="PowerSGD rank")
  p.add_argument("--bits", type=int, default=8, help="int8_block bits")
  p.add_argument("--format", default="e4m3", help="fp8_block format")
  p.add_argument("--threshold", type=float, default=1e-3,
                 help="threshold compressor's magnitude threshold")
  p.add_argument("--block-size", type=int, default=256,
                 help="int8_block / fp8_block elements per scale")
  p.add_argument("--error-feedback", choices=[*_ERROR_FEEDBACK, "ef21", "dgc"],
                 default="auto", help="auto: on for biased compressors")
  p.add_argument("--ratio-warmup-steps", type=int, default=0,
                 help="DGC's sparsity warm-up: stages of this many steps at "
                 "ratio 25%%, 6.25%%, ... down to --ratio, each its own "
                 "compiled step (0: none)")
  p.add_argument("--min-compress-size", type=int, default=0,
                 help="tensors with fewer elements go through an exact "
                 "all-reduce (biases, norms)")
  p.add_argument("--devices", type=int, default=8,
                 help="simulated CPU devices (ignored on GPU/TPU)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--max-steps", type=int, default=None)
  p.add_argument("--no-progress", action="store_true")


OPTIMIZERS = ("adam", "momentum", "sgd")
LR_SCHEDULES = ("constant", "cosine")  # char_lm's, after its warm-up


def optimizer(name: str, learning_rate):
  """The examples' optimizer after the compressed mean: ``"adam"``,
  ``"momentum"`` (SGD with Nesterov momentum 0.9, the optimizer of the
  PowerSGD and DGC papers) or ``"sgd"`` (plain SGD: for
  ``error_feedback="dgc"``, whose momentum correction keeps the momentum
  before the exchange).

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
  raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def compression_config(args: argparse.Namespace) -> dict[str, Any]:
  """The Config fields that :func:`add_compression_flags` sets."""
  return dict(
      compressor=args.compressor, ratio=args.ratio, levels=args.levels,
      rank=args.rank, bits=args.bits, format=args.format,
      threshold=args.threshold, block_size=args.block_size,
      error_feedback=_ERROR_FEEDBACK.get(args.error_feedback,
                                         args.error_feedback),
      min_compress_size=args.min_compress_size,
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


def ratio_stages(config) -> list[tuple[int, dict[str, Any]]]:
  """The run's stages as ``[(first_step, compressor kwargs), ...]``.

  Without ``config.ratio_warmup_steps`` one stage, from step 0, with
  :func:`compressor_kwargs`. With it, DGC's sparsity warm-up
  (:func:`jaxcomp.compressors.dgc_warmup_stages`): ``ratio`` 0.25 for that
  many steps, then 0.0625, ... down to ``config.ratio``. Each stage gets its
  own transform and compiled step, so each sends its own payload size (a
  scheduled ratio would keep the first stage's capacity all along).

  Raises:
    ValueError: ``ratio_warmup_steps`` < 0, or > 0 with a compressor that
      takes no ``ratio``.
  """
  kwargs = compressor_kwargs(config)
  if config.ratio_warmup_steps < 0:
    raise ValueError("ratio_warmup_steps must be >= 0, got "
                     f"{config.ratio_warmup_steps}")
  if not config.ratio_warmup_steps:
    return [(0, kwargs)]
  if "ratio" not in kwargs:
    raise ValueError(f"ratio_warmup_steps needs a compressor that takes a "
                     f"ratio (topk, dgc, random_block, ...), not "
                     f"{config.compressor!r}; set it to 0")
  import jaxcomp
  return [(first, dict(kwargs, ratio=r)) for first, r in
          jaxcomp.compressors.dgc_warmup_stages(config.ratio,
                                                config.ratio_warmup_steps)]


def stage_at(stages, step: int) -> int:
  """Index of the stage of :func:`ratio_stages` that ``step`` is in."""
  return max(i for i, (first, _) in enumerate(stages) if first <= step)


def stage_steps(config, stages, params, mesh, make_step, learning_rate):
  """The example's transform per stage of :func:`ratio_stages` (the
  compressed mean over ``"data"``, then ``config.optimizer``), each
  compiled into a train step.

  Args:
    config: the example's Config.
    stages: :func:`ratio_stages` ``(config)``.
    params: the initial parameters.
    mesh: the device mesh, with axis ``"data"``.
    make_step: ``tx -> step_fn(params, opt_state, batch) -> (params,
      opt_state, loss)``, run per device under ``shard_map``.
    learning_rate: a float or an Optax schedule.

  Returns:
    ``(opt_state, steps, stage_bytes)``: the sharded initial state, which
    every stage's step takes and returns; one jitted step per stage
    (parameters and state donated); and the bytes one device sends per step
    in each stage (the stage transform's statistics), for
    :func:`run_bytes`.

  Raises:
    ValueError: the stages' states differ in structure, shape or dtype.
  """
  import jax
  import optax
  import jaxcomp
  from jax.sharding import PartitionSpec as P
  txs = [optax.chain(
      jaxcomp.compressed_mean(config.compressor, "data",
                              min_compress_size=config.min_compress_size,
                              error_feedback=config.error_feedback,
                              seed=config.seed, **kwargs),
      optimizer(config.optimizer, learning_rate)) for _, kwargs in stages]
  inits = [jaxcomp.init_sharded(tx, params, mesh, "data") for tx in txs]
  sig = [jax.tree.map(lambda a: (a.shape, a.dtype), s) for s, _ in inits]
  if any(s != sig[0] for s in sig[1:]):
    raise ValueError("the compressor's state depends on its ratio, so "
                     "ratio_warmup_steps cannot carry it across stages; set "
                     "ratio_warmup_steps=0")
  stage_bytes = [float(jaxcomp.get_stats(s).bytes_sent) for s, _ in inits]
  opt_state, specs = inits[0]
  steps = [jax.jit(jaxcomp.shard_train_step(
      make_step(tx), mesh=mesh, state_specs=specs, batch_spec=P("data")),
                   donate_argnums=(0, 1)) for tx in txs]
  return opt_state, steps, stage_bytes


def run_bytes(stages, stage_bytes, steps_run: int) -> float:
  """Bytes one device sent over the first ``steps_run`` steps: each stage of
  :func:`ratio_stages` at its ``stage_bytes`` (from :func:`stage_steps`)."""
  ends = [first for first, _ in stages[1:]] + [steps_run]
  return sum(max(0, min(end, steps_run) - first) * b
             for (first, _), end, b in zip(stages, ends, stage_bytes))


def print_traffic(result: dict[str, Any]) -> None:
  """Prints the bytes each device sends per step, from the transform's
  statistics and from the collectives of the lowered step (on CPU, XLA's
  backend later promotes bf16 all-reduces to float32; GPUs keep bf16)."""
  print(f"bytes sent per device per step: {result['bytes_per_step']:.0f} "
        f"(dense {result['dense_bytes_per_step']:.0f}, ratio to dense "
        f"{result['bytes_per_step'] / result['dense_bytes_per_step']:.4f}, "
        f"compression {result['ratio_to_dense']:.1f}x)")
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
