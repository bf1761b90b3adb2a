"""Train a CNN (Flax NNX) on Fashion-MNIST over simulated devices with
jaxcomp.

  python -m examples.fashion_mnist.main --compressor=topk --ratio=0.01
"""

from __future__ import annotations

import argparse
import sys

from examples import common
from examples import xla_flags
from examples.fashion_mnist.config import Config


def parse(argv=None):
  defaults = Config()
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  common.add_compression_flags(p, defaults)
  common.add_run_flags(p, defaults, ("epochs", "batch_size", "learning_rate"))
  p.add_argument("--optimizer", choices=common.OPTIMIZERS,
                 default=defaults.optimizer,
                 help="after the compressed mean: adam, SGD with momentum, or "
                 "plain SGD (with --error-feedback dgc)")
  p.add_argument("--dataset", default=defaults.dataset,
                 choices=["auto", "fashion_mnist", "digits"])
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse(argv)
  if "jax" not in sys.modules:
    xla_flags.set_cpu_devices(args.devices)
  from examples.fashion_mnist import train
  import jax

  config = Config(
      dataset=args.dataset, epochs=args.epochs, batch_size=args.batch_size,
      learning_rate=args.learning_rate, optimizer=args.optimizer,
      **common.compression_config(args))
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; "
        f"compressor: {common.exchange_name(args)}", flush=True)
  result = train.train_and_evaluate(config)
  print(f"dataset: {result['dataset']}")
  for e in result["epochs"]:
    print(f"epoch {e['epoch']}: loss {e['loss']:.4f}  test accuracy "
          f"{e['test_accuracy']:.4f}  ({e['seconds']:.1f} s)")
  common.print_traffic(result)
  return 0


if __name__ == "__main__":
  sys.exit(main())
