"""The Fashion-MNIST example's defaults: the one place they are set (the
command-line flags of ``main.py`` take theirs from here)."""

from __future__ import annotations

import dataclasses

from examples.common import CompressionConfig


@dataclasses.dataclass
class Config(CompressionConfig):
  rank: int = 1  # PowerSGD rank
  dataset: str = "auto"  # "auto", "fashion_mnist" or "digits"
  epochs: int = 2
  batch_size: int = 256  # global, split over the devices
  learning_rate: float = 2e-3
  train_subset: int | None = None  # use only the first N training images
