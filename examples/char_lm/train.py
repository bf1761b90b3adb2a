"""Data-parallel character-level LM training with compressed gradient averaging."""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import optax

import jaxcomp
from examples import common
from examples.char_lm import data as data_lib
from examples.char_lm import model as model_lib
from examples.char_lm.config import Config

__all__ = ["Config", "SHARDINGS", "learning_rate_schedule",
           "train_and_evaluate"]

SHARDINGS = ("replicated", "fsdp", "hsdp")


def learning_rate_schedule(config: Config) -> optax.Schedule:
  """Linear warm-up from 0 over ``warmup_steps``, then the peak
  ``learning_rate`` (``"constant"``) or a cosine decay to 0 at the run's
  last step (``"cosine"``; the run has ``epochs * steps_per_epoch`` steps,
  or ``max_steps`` if fewer).

  Raises:
    ValueError: an unknown ``lr_schedule``.
  """
  if config.lr_schedule not in common.LR_SCHEDULES:
    raise ValueError(f"lr_schedule must be one of {common.LR_SCHEDULES}, got "
                     f"{config.lr_schedule!r}")
  warmup = max(config.warmup_steps, 1)
  if config.lr_schedule == "constant":
    return optax.linear_schedule(0.0, config.learning_rate, warmup)
  total = config.epochs * config.steps_per_epoch
  if config.max_steps is not None:
    total = min(total, config.max_steps)
  return optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, warmup,
                                            max(total, warmup + 1))


def init_model(config: Config):
  """``(model, params)``: the character transformer of ``config`` and its
  initial parameters (seed ``config.seed``)."""
  model = model_lib.CharTransformer(
      vocab_size=data_lib.VOCAB_SIZE, context=config.context,
      d_model=config.d_model, num_layers=config.num_layers,
      num_heads=config.num_heads)
  params = model.init(jax.random.key(config.seed),
                      jnp.zeros((1, config.context), jnp.int32))["params"]
  return model, params


def train_and_evaluate(config: Config) -> dict[str, Any]:
  """Trains the transformer on all local devices; returns per-epoch metrics.

  Returns:
    ``{"dataset", "epochs": [{"epoch", "loss", "valid_loss",
    "bits_per_char", "seconds"}], "steps", "bytes_per_step",
    "total_bytes", "dense_bytes_per_step", "compression",
    "wire_bytes_per_step", "wire_compression", "hlo_operand_bytes",
    "num_params", "param_bytes_per_device", "opt_state_bytes_per_device",
    "params"}`` (a compression factor is dense over
    compressed). Losses are mean cross-entropy in nats per
    character; bits per character is ``valid_loss / ln 2``.
    ``bytes_per_step`` is what one device sends per step after the ratio
    warm-up (``config.ratio_warmup_steps``), ``total_bytes`` the sum over
    all steps run, warm-up included.

  With ``config.sharding == "fsdp"`` the parameters and the optimizer
  state are flat shards over the devices (:mod:`jaxcomp.fsdp`) and the
  compressed exchange is a reduce-scatter (``output="shard"``); the
  returned ``params`` are whole. With ``"hsdp"`` the devices form a
  ``(config.hosts, devices)`` mesh: the parameters are sharded over a
  host's devices, the gradient reduce-scattered exactly there, and each
  shard averaged across hosts with the compressor; the bytes and
  compression reported are those across hosts.

  Raises:
    ValueError: ``batch_size`` is not a multiple of the device count, an
      unknown ``lr_schedule`` or ``sharding``, a bad compressor name or hyperparameter, or
      a ``ratio_warmup_steps`` the compressor cannot take.
  """
  n_dev = jax.device_count()
  learning_rate_schedule(config)  # bad schedules fail before any work
  if config.batch_size % n_dev:
    raise ValueError(f"batch_size={config.batch_size} must be a multiple of "
                     f"the device count {n_dev}")
  stages = common.stages(config, learning_rate_schedule(config),
                         muon_dimensions=model_lib.muon_dimensions)
  corpus = data_lib.load(max_train_bytes=config.max_train_bytes)
  length = config.context + 1  # inputs and next-character targets
  valid = data_lib.fixed_windows(corpus.valid, config.valid_windows, length)

  hsdp = config.sharding == "hsdp"
  if hsdp and (config.hosts < 1 or n_dev % config.hosts):
    raise ValueError(f"hosts={config.hosts} must divide the device count {n_dev}")
  axes = ("hosts", "devices") if hsdp else "data"
  mesh = (jax.make_mesh((config.hosts, n_dev // config.hosts), axes) if hsdp
          else jax.make_mesh((n_dev,), ("data",)))
  model, params = init_model(config)
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))

  def loss_fn(p, windows):
    logits = model.apply({"params": p}, windows[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, windows[:, 1:]).mean()

  # One compiled step per warm-up stage (one without warm-up), all carrying
  # the same optimizer state.
  if config.sharding not in SHARDINGS:
    raise ValueError(f"sharding must be one of {SHARDINGS}, got "
                     f"{config.sharding!r}")
  fsdp = config.sharding == "fsdp"
  if config.param_compressor and not (fsdp or hsdp):
    raise ValueError("param_compressor needs sharding='fsdp' or 'hsdp'")
  if config.diloco_every and (fsdp or hsdp or config.ratio_warmup_steps):
    raise ValueError("diloco_every runs with sharding='replicated' and no "
                     "ratio warm-up")
  onebit = config.optimizer in common.COMPRESSED_OPTIMIZERS
  if onebit and (fsdp or hsdp or config.diloco_every
                 or config.ratio_warmup_steps):
    raise ValueError(f"optimizer {config.optimizer!r} runs with "
                     "sharding='replicated', no DiLoCo and no ratio warm-up")
  # The compressed optimizers count their bytes by phase in their state
  # (jaxcomp.get_stats), read after the run.
  stage_bytes = [] if onebit else common.stage_bytes(
      stages, params, mesh, "diloco" if config.diloco_every else config.sharding)
  if config.optimizer == "zero_one_adam":
    # Local steps between 1-bit syncs: one copy of the parameters per
    # device, evaluated at the last synchronised one.
    layout = jaxcomp.Islands()
    stages_run = stages
  elif config.diloco_every:
    # Per-device parameters between syncs; evaluated at the synchronized
    # ones. An exchange happens every diloco_every steps.
    layout = jaxcomp.Islands()
    stages_run = stages[:1]
    stage_bytes = [b / config.diloco_every for b in stage_bytes]
  elif fsdp or hsdp:
    # Parameters and optimizer state as flat shards over the devices (HSDP:
    # a host's devices); the gradient of the gathered parameters is
    # reduce-scattered, compressed (HSDP: exactly, then compressed across).
    layout = jaxcomp.FSDP(shard_axis="devices" if hsdp else None,
                          param_compressor=config.param_compressor)
    stages_run = stages
  else:
    layout = jaxcomp.DataParallel()
    stages_run = stages
  state = jaxcomp.init(stages[0].tx, params, mesh, layout=layout, axis_name=axes)
  steps = [jaxcomp.make_train_step(loss_fn, st.tx, mesh=mesh, layout=layout,
                                   axis_name=axes) for st in stages_run]
  memory = {"param_bytes_per_device": jaxcomp.fsdp.state_bytes(state.params),
            "opt_state_bytes_per_device": jaxcomp.fsdp.state_bytes(state.opt_state)}
  batch_sharding = NamedSharding(mesh, P(axes))

  rng = np.random.default_rng(config.seed)

  def next_batch():
    return jax.device_put(
        data_lib.random_windows(corpus.train, config.batch_size, length, rng),
        batch_sharding)

  # The traffic of the last stage: what the run sends once warmed up.
  traffic = jaxcomp.collective_traffic(
      steps[-1].lower(state, next_batch()))

  eval_loss = jax.jit(loss_fn)

  def evaluate(p):
    total = 0.0
    for i in range(0, len(valid), 64):
      w = valid[i:i + 64]
      total += float(eval_loss(p, w)) * len(w)
    return total / len(valid)

  history, done = [], 0
  for epoch in range(config.epochs):
    t0 = time.perf_counter()
    losses = []
    it = range(config.steps_per_epoch)
    if config.progress:
      from tqdm import tqdm
      it = tqdm(it, desc=f"epoch {epoch + 1}/{config.epochs}", leave=False)
    for _ in it:
      if config.max_steps is not None and done >= config.max_steps:
        break
      i = jaxcomp.compressors.stage_at(stages, done)
      state, loss = steps[i](state, next_batch())
      # Wait for each step: with many steps in flight, simulated CPU devices
      # (threads sharing one pool) were seen to deadlock in a collective.
      losses.append(float(loss))
      done += 1
    train_loss = float(np.mean(losses)) if losses else float("nan")
    valid_loss = evaluate(state.model_params())
    history.append({"epoch": epoch + 1, "loss": train_loss,
                    "valid_loss": valid_loss,
                    "bits_per_char": valid_loss / math.log(2),
                    "seconds": time.perf_counter() - t0})
    if onebit:  # bytes so far, by the optimizer's own counts
      history[-1]["total_wire_bytes"] = jaxcomp.get_stats(
          state.opt_state).total_wire_bytes
    if config.progress:
      print(f"epoch {epoch + 1}: {done} steps, validation loss "
            f"{valid_loss:.4f}", flush=True)
    if config.max_steps is not None and done >= config.max_steps:
      break
  if onebit:
    return _onebit_result(config, corpus, valid, history, done, num_params,
                          state, traffic, memory)
  stats = common.exchange_stats(state.opt_state, config.sharding)
  per_sync = stats.every  # steps per exchange (DiLoCo: one per sync)
  return {
      "dataset": _dataset(config, corpus, valid),
      "epochs": history,
      "steps": done,
      "num_params": num_params,
      "bytes_per_step": float(stats.bytes_sent) / per_sync,
      "total_bytes": jaxcomp.compressors.bytes_over(stages, stage_bytes, done),
      "dense_bytes_per_step": float(stats.dense_bytes),
      "compression": float(stats.compression_factor) * per_sync,
      "wire_bytes_per_step": float(stats.wire_bytes) / per_sync,
      "wire_compression": float(stats.wire_compression_factor) * per_sync,
      "total_wire_bytes": (float(stats.wire_bytes) / per_sync * done
                           if len(stages) == 1 else None),
      "hlo_operand_bytes": traffic.operand_bytes,
      **memory,
      "params": state.model_params(),
  }


def _dataset(config: Config, corpus, valid) -> str:
  return (f"CPython {corpus.python_version} stdlib: "
          f"{len(corpus.train_files)} train files "
          f"({len(corpus.train)} bytes used), "
          f"{len(corpus.valid_files)} held out "
          f"({len(valid)} windows of {config.context})")


def _onebit_result(config: Config, corpus, valid, history, done, num_params,
                   state, traffic, memory) -> dict[str, Any]:
  """:func:`train_and_evaluate`'s result for a compressed optimizer: the
  bytes of its phases (dense warm-up, 1-bit exchanges, rounds that sent
  nothing) from :func:`jaxcomp.get_stats`."""
  t = jaxcomp.get_stats(state.opt_state)
  return {
      "dataset": _dataset(config, corpus, valid),
      "epochs": history,
      "steps": done,
      "num_params": num_params,
      "bytes_per_step": t.compressed_bytes_per_exchange,
      "total_bytes": t.total_bytes,
      "dense_bytes_per_step": t.dense_bytes_per_exchange,
      "compression": t.reduction,
      "wire_bytes_per_step": t.total_wire_bytes / max(done, 1),
      "wire_compression": t.wire_reduction,
      "total_wire_bytes": t.total_wire_bytes,
      "dense_steps": t.dense_steps,
      "compressed_steps": t.compressed_steps,
      "silent_steps": t.silent_steps,
      "skipped_steps": t.skipped_steps,  # for a NaN/Inf gradient (nonfinite="skip")
      "hlo_operand_bytes": traffic.operand_bytes,
      **memory,
      "params": state.model_params(),
  }
