"""Data-parallel CNN training with compressed gradient averaging."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import optax

import jaxcomp
from examples import common
from examples.fashion_mnist import data as data_lib


@dataclasses.dataclass
class Config:
  dataset: str = "auto"  # "auto", "fashion_mnist" or "digits"
  compressor: str = "identity"  # a name from jaxcomp.compressors.names()
  ratio: float = 0.01  # top-k / random-block fraction sent
  levels: int = 4  # QSGD levels
  rank: int = 1  # PowerSGD rank
  bits: int = 8  # int8_block bits (2, 4 or 8)
  format: str = "e4m3"  # fp8_block format
  threshold: float = 1e-3  # threshold compressor's magnitude threshold
  block_size: int = 256  # int8_block / fp8_block elements per scale
  error_feedback: bool | str | None = None  # None: on for biased ones
  min_compress_size: int = 0  # smaller tensors: exact all-reduce
  ratio_warmup_steps: int = 0  # DGC sparsity warm-up stage length (0: none)
  optimizer: str = "adam"  # one of examples.common.OPTIMIZERS
  epochs: int = 2
  batch_size: int = 256  # global, split over the devices
  learning_rate: float = 2e-3
  seed: int = 0
  max_steps: int | None = None  # stop early (tests)
  train_subset: int | None = None  # use only the first N training images
  progress: bool = True


class CNN(nn.Module):
  """Two conv layers and two dense layers (about 0.42M parameters at 28x28)."""

  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(32, (3, 3))(x))
    x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x = nn.relu(nn.Conv(64, (3, 3))(x))
    x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(128)(x))
    return nn.Dense(self.num_classes)(x)


def train_and_evaluate(config: Config) -> dict[str, Any]:
  """Trains the CNN on all local devices; returns per-epoch metrics.

  Returns:
    ``{"dataset", "epochs": [{"epoch", "loss", "test_accuracy", "seconds"}],
    "bytes_per_step", "total_bytes", "dense_bytes_per_step",
    "ratio_to_dense", "hlo_operand_bytes", "hlo_dense_operand_bytes",
    "steps"}``. ``bytes_per_step`` is what one device sends per step after
    the ratio warm-up (``config.ratio_warmup_steps``), ``total_bytes`` the
    sum over all steps run, warm-up included.

  Raises:
    ValueError: ``batch_size`` is not a multiple of the device count, a bad
      compressor name or hyperparameter, or a ``ratio_warmup_steps`` the
      compressor cannot take.
  """
  stages = common.ratio_stages(config)  # bad names fail before any work
  ds = data_lib.load(config.dataset)
  train_x, train_y = ds.train_images, ds.train_labels
  if config.train_subset:
    train_x, train_y = train_x[:config.train_subset], train_y[:config.train_subset]
  n_dev = jax.device_count()
  if config.batch_size % n_dev:
    raise ValueError(f"batch_size={config.batch_size} must be a multiple of "
                     f"the device count {n_dev}")
  mesh = jax.make_mesh((n_dev,), ("data",))
  model = CNN(ds.num_classes)
  params = model.init(jax.random.key(config.seed), train_x[:1])["params"]

  def loss_fn(p, x, y):
    logits = model.apply({"params": p}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def make_step(tx):
    def step(p, s, batch):
      x, y = batch
      loss, g = jaxcomp.per_device_value_and_grad(loss_fn, "data")(p, x, y)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s, lax.pmean(loss, "data")
    return step

  # One transform and compiled step per warm-up stage (one without warm-up),
  # all carrying the same optimizer state.
  opt_state, steps, stage_bytes = common.stage_steps(
      config, stages, params, mesh, make_step, config.learning_rate)
  replicated = NamedSharding(mesh, P())
  batch_sharding = NamedSharding(mesh, P("data"))
  params = jax.device_put(params, replicated)

  bs = config.batch_size
  steps_per_epoch = len(train_y) // bs
  example = jax.device_put((train_x[:bs], train_y[:bs]), batch_sharding)
  # The traffic of the last stage: what the run sends once warmed up.
  traffic = jaxcomp.collective_traffic(
      steps[-1].lower(params, opt_state, example))
  dense_tx = optax.chain(jaxcomp.compressed_mean("identity", "data"),
                         common.optimizer(config.optimizer, config.learning_rate))
  dense_state, dense_specs = jaxcomp.init_sharded(dense_tx, params, mesh, "data")
  dense_traffic = jaxcomp.collective_traffic(jax.jit(jaxcomp.shard_train_step(
      make_step(dense_tx), mesh=mesh, state_specs=dense_specs,
      batch_spec=P("data"))).lower(params, dense_state, example))
  del dense_state

  @jax.jit
  def accuracy(p, x, y):
    return jnp.mean(jnp.argmax(model.apply({"params": p}, x), -1) == y)

  def evaluate(p):
    hits = 0.0
    for i in range(0, len(ds.test_labels), 1000):
      x, y = ds.test_images[i:i + 1000], ds.test_labels[i:i + 1000]
      hits += float(accuracy(p, x, y)) * len(y)
    return hits / len(ds.test_labels)

  rng = np.random.default_rng(config.seed)
  history, total = [], 0
  for epoch in range(config.epochs):
    t0 = time.perf_counter()
    perm = rng.permutation(len(train_y))
    losses = []
    it = range(steps_per_epoch)
    if config.progress:
      from tqdm import tqdm
      it = tqdm(it, desc=f"epoch {epoch + 1}/{config.epochs}", leave=False)
    for s in it:
      if config.max_steps is not None and total >= config.max_steps:
        break
      idx = perm[s * bs:(s + 1) * bs]
      batch = jax.device_put((train_x[idx], train_y[idx]), batch_sharding)
      i = common.stage_at(stages, total)
      params, opt_state, loss = steps[i](params, opt_state, batch)
      # Wait for each step: simulated CPU devices share one thread pool, and
      # steps dispatched ahead can occupy it with participants of a later
      # all-reduce while an earlier one still waits for its last device.
      losses.append(float(loss))
      total += 1
    mean_loss = float(np.mean(losses)) if losses else float("nan")
    history.append({"epoch": epoch + 1, "loss": mean_loss,
                    "test_accuracy": evaluate(params),
                    "seconds": time.perf_counter() - t0})
    if config.max_steps is not None and total >= config.max_steps:
      break
  stats = jaxcomp.get_stats(opt_state)
  return {
      "dataset": ds.name,
      "epochs": history,
      "steps": total,
      "bytes_per_step": float(stats.bytes_sent),
      "total_bytes": common.run_bytes(stages, stage_bytes, total),
      "dense_bytes_per_step": float(stats.dense_bytes),
      "ratio_to_dense": float(stats.compression_factor),
      "hlo_operand_bytes": traffic.operand_bytes,
      "hlo_dense_operand_bytes": dense_traffic.operand_bytes,
      "params": params,
  }
