"""Train a character-level transformer on the CPython standard library's
source over simulated devices with jaxcomp.

  python -m examples.char_lm.main --compressor=topk --ratio=0.01
  python -m examples.char_lm.main --sharding=fsdp --compressor=int8_block
"""

from __future__ import annotations

import argparse
import sys

from examples import common
from examples.char_lm.config import Config


def parse(argv=None):
  defaults = Config()
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  common.add_compression_flags(p, defaults)
  common.add_run_flags(p, defaults, (
      "epochs", "steps_per_epoch", "batch_size", "context", "d_model",
      "learning_rate"))
  p.add_argument("--layers", type=int, default=defaults.num_layers)
  p.add_argument("--heads", type=int, default=defaults.num_heads)
  p.add_argument("--optimizer", choices=common.OPTIMIZERS + common.COMPRESSED_OPTIMIZERS,
                 default=defaults.optimizer,
                 help="after the compressed mean: adam, SGD with momentum, or "
                 "plain SGD (with --error-feedback dgc)")
  p.add_argument("--sharding", choices=("replicated", "fsdp", "hsdp"),
                 default=defaults.sharding,
                 help="fsdp: parameters and optimizer state sharded over the "
                 "devices, the gradient reduce-scattered (compressed); hsdp: "
                 "sharded over each host's devices (exact reduce-scatter "
                 "there), the shards averaged across --hosts compressed")
  p.add_argument("--hosts", type=int, default=defaults.hosts,
                 help="with --sharding hsdp: simulated hosts the devices are "
                 "split into (default 2)")
  p.add_argument("--param-compressor", default=None,
                 help="with --sharding fsdp: compress the parameters' forward "
                 "all-gather (ZeRO++'s qwZ), e.g. int8_block")
  p.add_argument("--diloco-fragments", type=int, default=defaults.diloco_fragments,
                 help="with --diloco-every: Streaming DiLoCo's fragments, synced "
                 "on staggered steps")
  p.add_argument("--diloco-every", type=int, default=defaults.diloco_every,
                 help="> 0: DiLoCo, the optimizer per device and a compressed "
                 "pseudo-gradient exchange every this many steps")
  p.add_argument("--freeze-step", type=int, default=defaults.freeze_step,
                 help="onebit_adam / onebit_lamb: dense warm-up steps; "
                 "zero_one_adam: the last step that updates the variance")
  p.add_argument("--local-step-scaler", type=int,
                 default=defaults.local_step_scaler,
                 help="zero_one_adam: frozen steps before the local interval "
                 "doubles")
  p.add_argument("--local-step-clipper", type=int,
                 default=defaults.local_step_clipper,
                 help="zero_one_adam: the longest local interval")
  p.add_argument("--lr-schedule", choices=common.LR_SCHEDULES,
                 default=defaults.lr_schedule,
                 help="after the warm-up: constant, or cosine decay to 0 at the last step")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse(argv)
  if "jax" not in sys.modules:
    from examples import xla_flags
    xla_flags.set_cpu_devices(args.devices)
  from examples.char_lm import train
  import jax

  config = Config(
      epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
      batch_size=args.batch_size, context=args.context, d_model=args.d_model,
      num_layers=args.layers, num_heads=args.heads,
      learning_rate=args.learning_rate, optimizer=args.optimizer,
      lr_schedule=args.lr_schedule, sharding=args.sharding, hosts=args.hosts,
      diloco_every=args.diloco_every, diloco_fragments=args.diloco_fragments,
      param_compressor=args.param_compressor, freeze_step=args.freeze_step,
      local_step_scaler=args.local_step_scaler,
      local_step_clipper=args.local_step_clipper,
      **common.compression_config(args))
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; "
        f"compressor: {common.exchange_name(args)}", flush=True)
  result = train.train_and_evaluate(config)
  print(f"dataset: {result['dataset']}")
  print(f"model: {result['num_params']} parameters")
  for e in result["epochs"]:
    print(f"epoch {e['epoch']}: train loss {e['loss']:.4f}  validation loss "
          f"{e['valid_loss']:.4f}  bits per character "
          f"{e['bits_per_char']:.3f}  ({e['seconds']:.1f} s)")
  common.print_traffic(result)
  print(f"memory per device: parameters {result['param_bytes_per_device']} B, "
        f"optimizer state {result['opt_state_bytes_per_device']} B "
        f"({args.sharding})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
