"""The Fashion-MNIST example runs, and top-k + error feedback keeps accuracy."""

import os

import jax
import numpy as np
import pytest

from examples.fashion_mnist import data as data_lib
from examples.fashion_mnist import main as main_lib
from examples.fashion_mnist import train


@pytest.fixture(autouse=True)
def standard_promotion():
  # optax.adam mixes int32 counts and floats, which strict promotion rejects.
  with jax.numpy_dtype_promotion("standard"):
    yield


EPOCHS = 16


def _digits(compressor, **kw):
  config = train.Config(dataset="digits", compressor=compressor, epochs=EPOCHS,
                        batch_size=64, learning_rate=3e-3, seed=0,
                        progress=False, **kw)
  return train.train_and_evaluate(config)


def test_topk_with_error_feedback_within_two_points_of_identity(mesh8):
  dense = _digits("identity")
  topk = _digits("topk", ratio=0.01)
  acc_dense = dense["epochs"][-1]["test_accuracy"]
  acc_topk = topk["epochs"][-1]["test_accuracy"]
  assert acc_dense > 0.9  # the model really learns
  assert acc_topk >= acc_dense - 0.02, (acc_topk, acc_dense)
  assert topk["compression"] > 20
  assert topk["steps"] == dense["steps"] == EPOCHS * (1348 // 64)


def test_main_runs_a_few_steps(mesh8, capsys):
  dataset = ("fashion_mnist" if os.path.exists(os.path.join(
      data_lib.FASHION_DIR, "train-images-idx3-ubyte.gz")) else "digits")
  assert main_lib.main(["--compressor=qsgd", "--epochs=1",
                        "--max-steps=3", "--batch-size=64", "--no-progress",
                        f"--dataset={dataset}"]) == 0
  out = capsys.readouterr().out
  assert f"dataset: {dataset}" in out
  assert "test accuracy" in out and "bytes sent per device per step" in out


def test_unknown_dataset_and_bad_batch():
  with pytest.raises(ValueError, match="dataset"):
    data_lib.load("cifar")
  with pytest.raises(ValueError, match="batch_size"):
    train.train_and_evaluate(train.Config(dataset="digits", batch_size=60,
                                          progress=False))


def test_fashion_mnist_reader_shapes():
  if not os.path.exists(os.path.join(data_lib.FASHION_DIR,
                                     "t10k-images-idx3-ubyte.gz")):
    pytest.skip("dataset-fashion-mnist is not installed")
  ds = data_lib.load_fashion_mnist()
  assert ds.train_images.shape == (60000, 28, 28, 1)
  assert ds.test_images.shape == (10000, 28, 28, 1)
  assert set(np.unique(ds.train_labels)) == set(range(10))
  assert 0.0 <= ds.train_images.min() and ds.train_images.max() <= 1.0
