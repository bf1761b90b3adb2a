"""The character-LM example's defaults: the one place they are set (the
command-line flags of ``main.py`` take theirs from here)."""

from __future__ import annotations

import dataclasses

from examples.common import CompressionConfig


@dataclasses.dataclass
class Config(CompressionConfig):
  epochs: int = 3
  steps_per_epoch: int = 100  # an "epoch" is this many steps on random windows
  batch_size: int = 32  # global, split over the devices
  context: int = 64
  d_model: int = 128
  num_layers: int = 2
  num_heads: int = 4
  learning_rate: float = 3e-3
  warmup_steps: int = 50
  lr_schedule: str = "constant"  # after the warm-up: "constant" or "cosine" (to 0)
  max_train_bytes: int | None = 2_000_000  # a subset of the training files
  valid_windows: int = 256  # held-out windows of `context` predictions each
  sharding: str = "replicated"  # or "fsdp": parameters and optimizer state
  #                               sharded over the devices (jaxcomp.fsdp); or
  #                               "hsdp": sharded over a host's devices (exact
  #                               reduce-scatter), the shards' compressed mean
  #                               across `hosts`
  hosts: int = 2  # hsdp: the devices split into this many simulated hosts
  param_compressor: str | None = None  # fsdp: compress the parameters'
  #                                      forward all-gather (e.g. "int8_block")
  diloco_fragments: int = 1  # Streaming DiLoCo's fragments (diloco_every > 0)
  diloco_outer_lr: float = 0.7  # DiLoCo's outer SGD (the paper's Nesterov 0.7
  diloco_outer_momentum: float = 0.9  # / 0.9; SparseLoCo: 1.0 / 0, error
  #                                     feedback in place of the momentum)
  diloco_every: int = 0  # > 0: DiLoCo, a compressed pseudo-gradient
  #                        exchange every this many steps (jaxcomp.diloco)
