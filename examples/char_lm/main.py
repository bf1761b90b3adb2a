"""Train a character-level transformer on the CPython standard library's
source over simulated devices with jaxcomp.

  python -m examples.char_lm.main --compressor=topk --ratio=0.01
"""

from __future__ import annotations

import argparse
import os
import sys


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--compressor", default="topk",
                 help="compressor name (see jaxcomp.compressors.names())")
  p.add_argument("--ratio", type=float, default=0.01,
                 help="fraction sent by top-k / random-block")
  p.add_argument("--levels", type=int, default=4, help="QSGD levels")
  p.add_argument("--rank", type=int, default=4, help="PowerSGD rank")
  p.add_argument("--bits", type=int, default=8, help="int8_block bits")
  p.add_argument("--format", default="e4m3", help="fp8_block format")
  p.add_argument("--threshold", type=float, default=1e-3,
                 help="threshold compressor's magnitude threshold")
  p.add_argument("--block-size", type=int, default=256,
                 help="int8_block / fp8_block elements per scale")
  p.add_argument("--error-feedback", choices=["auto", "on", "off", "ef21", "dgc"],
                 default="auto", help="auto: on for biased compressors")
  p.add_argument("--epochs", type=int, default=3)
  p.add_argument("--steps-per-epoch", type=int, default=100)
  p.add_argument("--batch-size", type=int, default=32, help="global batch")
  p.add_argument("--context", type=int, default=64)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--learning-rate", type=float, default=3e-3)
  p.add_argument("--devices", type=int, default=8,
                 help="simulated CPU devices (ignored on GPU/TPU)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--max-steps", type=int, default=None)
  p.add_argument("--no-progress", action="store_true")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse(argv)
  if "jax" not in sys.modules:
    from examples import xla_flags
    xla_flags.set_cpu_devices(args.devices)
  from examples.char_lm import train
  import jax

  config = train.Config(
      compressor=args.compressor, ratio=args.ratio, levels=args.levels,
      rank=args.rank, bits=args.bits, format=args.format,
      threshold=args.threshold, block_size=args.block_size,
      error_feedback={"auto": None, "on": True, "off": False}.get(
          args.error_feedback, args.error_feedback),
      epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
      batch_size=args.batch_size, context=args.context, d_model=args.d_model,
      num_layers=args.layers, num_heads=args.heads,
      learning_rate=args.learning_rate, seed=args.seed,
      max_steps=args.max_steps, progress=not args.no_progress)
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; "
        f"compressor: {args.compressor}", flush=True)
  result = train.train_and_evaluate(config)
  print(f"dataset: {result['dataset']}")
  print(f"model: {result['num_params']} parameters")
  for e in result["epochs"]:
    print(f"epoch {e['epoch']}: train loss {e['loss']:.4f}  validation loss "
          f"{e['valid_loss']:.4f}  bits per character "
          f"{e['bits_per_char']:.3f}  ({e['seconds']:.1f} s)")
  print(f"bytes sent per device per step: {result['bytes_per_step']:.0f} "
        f"(dense {result['dense_bytes_per_step']:.0f}, ratio to dense "
        f"{result['bytes_per_step'] / result['dense_bytes_per_step']:.4f}, "
        f"compression {result['ratio_to_dense']:.1f}x)")
  print(f"collective operand bytes per device per step from the lowered "
        f"HLO: {result['hlo_operand_bytes']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
