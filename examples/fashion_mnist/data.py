"""Fashion-MNIST from Debian's dataset-fashion-mnist, or scikit-learn digits."""

from __future__ import annotations

import gzip
import os
from typing import NamedTuple

import numpy as np

FASHION_DIR = "/usr/share/datasets/fashion-mnist"


class Dataset(NamedTuple):
  name: str
  train_images: np.ndarray  # (N, H, W, 1) float32 in [0, 1]
  train_labels: np.ndarray  # (N,) int32
  test_images: np.ndarray
  test_labels: np.ndarray
  num_classes: int


def _read_idx(path: str) -> np.ndarray:
  with gzip.open(path, "rb") as f:
    data = f.read()
  ndim = data[3]
  dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
  return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_fashion_mnist(directory: str = FASHION_DIR) -> Dataset:
  """The full Fashion-MNIST (60k train, 10k test) from its idx files.

  Raises:
    FileNotFoundError: the idx files are not in ``directory`` (install them
      with ``apt-get install dataset-fashion-mnist``).
  """
  def read(stem):
    path = os.path.join(directory, stem + "-ubyte.gz")
    if not os.path.exists(path):
      raise FileNotFoundError(
          f"{path} not found; install Debian's dataset-fashion-mnist "
          "(apt-get install dataset-fashion-mnist) or use --dataset=digits")
    return _read_idx(path)

  def images(a):
    return (a.astype(np.float32) / 255.0)[..., None]

  return Dataset("fashion_mnist",
                 images(read("train-images-idx3")),
                 read("train-labels-idx1").astype(np.int32),
                 images(read("t10k-images-idx3")),
                 read("t10k-labels-idx1").astype(np.int32), 10)


def load_digits(test_fraction: float = 0.25, seed: int = 0) -> Dataset:
  """scikit-learn's bundled 8x8 digits (1797 images), split train/test."""
  from sklearn.datasets import load_digits as sk_digits
  d = sk_digits()
  x = (d.images.astype(np.float32) / 16.0)[..., None]
  y = d.target.astype(np.int32)
  perm = np.random.default_rng(seed).permutation(len(y))
  n_test = int(len(y) * test_fraction)
  te, tr = perm[:n_test], perm[n_test:]
  return Dataset("digits", x[tr], y[tr], x[te], y[te], 10)


def load(name: str = "auto") -> Dataset:
  """``"fashion_mnist"``, ``"digits"``, or ``"auto"`` (Fashion-MNIST where
  its files exist, else digits)."""
  if name == "auto":
    exists = os.path.exists(os.path.join(FASHION_DIR,
                                         "train-images-idx3-ubyte.gz"))
    name = "fashion_mnist" if exists else "digits"
  if name == "fashion_mnist":
    return load_fashion_mnist()
  if name == "digits":
    return load_digits()
  raise ValueError(
      f"dataset must be 'auto', 'fashion_mnist' or 'digits', got {name!r}")
