"""Data-parallel CNN training (Flax NNX) with compressed gradient averaging."""

from __future__ import annotations

import time
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import optax

import jaxcomp
import jaxcomp.flax
from examples import common
from examples.fashion_mnist import data as data_lib
from examples.fashion_mnist.config import Config

__all__ = ["CNN", "Config", "train_and_evaluate"]


class CNN(nnx.Module):
  """Two conv layers and two dense layers (about 0.42M parameters at 28x28)."""

  def __init__(self, num_classes: int, *, image_shape=(28, 28, 1),
               rngs: nnx.Rngs):
    h, w, c = image_shape
    self.conv1 = nnx.Conv(c, 32, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
    self.dense1 = nnx.Linear((h // 4) * (w // 4) * 64, 128, rngs=rngs)
    self.dense2 = nnx.Linear(128, num_classes, rngs=rngs)

  def __call__(self, x):
    x = nnx.max_pool(nnx.relu(self.conv1(x)), (2, 2), strides=(2, 2))
    x = nnx.max_pool(nnx.relu(self.conv2(x)), (2, 2), strides=(2, 2))
    x = nnx.relu(self.dense1(x.reshape(x.shape[0], -1)))
    return self.dense2(x)


def _loss(model, batch):
  x, y = batch
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def train_and_evaluate(config: Config) -> dict[str, Any]:
  """Trains the CNN on all local devices; returns per-epoch metrics.

  Returns:
    ``{"dataset", "epochs": [{"epoch", "loss", "test_accuracy", "seconds"}],
    "bytes_per_step", "total_bytes", "dense_bytes_per_step", "compression",
    "wire_bytes_per_step", "wire_compression", "hlo_operand_bytes",
    "hlo_dense_operand_bytes", "steps", "model"}``. ``bytes_per_step`` is
    what one device sends per step after the ratio warm-up
    (``config.ratio_warmup_steps``), ``total_bytes`` the sum over all steps
    run, warm-up included; a compression factor is dense over compressed.

  Raises:
    ValueError: ``batch_size`` is not a multiple of the device count, a bad
      compressor name or hyperparameter, or a ``ratio_warmup_steps`` the
      compressor cannot take.
  """
  stages = common.stages(config, config.learning_rate)  # bad names fail first
  ds = data_lib.load(config.dataset)
  train_x, train_y = ds.train_images, ds.train_labels
  if config.train_subset:
    train_x, train_y = train_x[:config.train_subset], train_y[:config.train_subset]
  n_dev = jax.device_count()
  if config.batch_size % n_dev:
    raise ValueError(f"batch_size={config.batch_size} must be a multiple of "
                     f"the device count {n_dev}")
  mesh = jax.make_mesh((n_dev,), ("data",))
  model = CNN(ds.num_classes, image_shape=train_x.shape[1:],
              rngs=nnx.Rngs(config.seed))
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  stage_bytes = common.stage_bytes(stages, params, mesh)
  # One optimizer state through every warm-up stage; each stage swaps in its
  # transformation, for which train_step compiles a step of its own.
  optimizer = jaxcomp.flax.Optimizer(model, stages[0].tx, wrt=nnx.Param,
                                     mesh=mesh)
  train_step = jaxcomp.flax.train_step(_loss)
  batch_sharding = NamedSharding(mesh, P("data"))

  bs = config.batch_size
  steps_per_epoch = len(train_y) // bs
  example = jax.device_put((train_x[:bs], train_y[:bs]), batch_sharding)
  # The traffic of the last stage, what the run sends once warmed up, and
  # of the dense step.
  last = jaxcomp.flax.Optimizer(model, stages[-1].tx, wrt=nnx.Param,
                                mesh=mesh)
  traffic = jaxcomp.collective_traffic(train_step.lower(model, last, example))
  dense = jaxcomp.flax.Optimizer(model, optax.chain(
      jaxcomp.compressed_mean("identity", "data"),
      common.optimizer(config.optimizer, config.learning_rate)),
      wrt=nnx.Param, mesh=mesh)
  dense_traffic = jaxcomp.collective_traffic(
      train_step.lower(model, dense, example))
  del last, dense

  @nnx.jit
  def hits(model, x, y):
    return jnp.sum(jnp.argmax(model(x), -1) == y)

  def evaluate():
    total = 0
    for i in range(0, len(ds.test_labels), 1000):
      total += int(hits(model, ds.test_images[i:i + 1000],
                        ds.test_labels[i:i + 1000]))
    return total / len(ds.test_labels)

  rng = np.random.default_rng(config.seed)
  history, done = [], 0
  for epoch in range(config.epochs):
    t0 = time.perf_counter()
    perm = rng.permutation(len(train_y))
    losses = []
    it = range(steps_per_epoch)
    if config.progress:
      from tqdm import tqdm
      it = tqdm(it, desc=f"epoch {epoch + 1}/{config.epochs}", leave=False)
    for s in it:
      if config.max_steps is not None and done >= config.max_steps:
        break
      idx = perm[s * bs:(s + 1) * bs]
      batch = jax.device_put((train_x[idx], train_y[idx]), batch_sharding)
      optimizer.tx = stages[jaxcomp.compressors.stage_at(stages, done)].tx
      # Wait for each step (float): simulated CPU devices share one thread
      # pool, and steps dispatched ahead can deadlock in a collective.
      losses.append(float(train_step(model, optimizer, batch)))
      done += 1
    mean_loss = float(np.mean(losses)) if losses else float("nan")
    history.append({"epoch": epoch + 1, "loss": mean_loss,
                    "test_accuracy": evaluate(),
                    "seconds": time.perf_counter() - t0})
    if config.max_steps is not None and done >= config.max_steps:
      break
  stats = jaxcomp.get_stats(nnx.as_pure(optimizer.opt_state))
  return {
      "dataset": ds.name,
      "epochs": history,
      "steps": done,
      "bytes_per_step": float(stats.bytes_sent),
      "total_bytes": jaxcomp.compressors.bytes_over(stages, stage_bytes, done),
      "dense_bytes_per_step": float(stats.dense_bytes),
      "compression": float(stats.compression_factor),
      "wire_bytes_per_step": float(stats.wire_bytes),
      "wire_compression": float(stats.wire_compression_factor),
      "hlo_operand_bytes": traffic.operand_bytes,
      "hlo_dense_operand_bytes": dense_traffic.operand_bytes,
      "model": model,
  }
