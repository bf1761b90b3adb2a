"""Built-in model profiles: ResNet-50, ResNet-18 for CIFAR-10, BERT-base and GPT-2 small.

Gradient tensor sizes are exact (built from the architectures: torchvision's
ResNet-50 v1.5, 25,557,032 parameters; the CIFAR-10 ResNet-18 of Kuang Liu's
pytorch-cifar, which PowerSGD's experiments train, 11,173,962; BERT-base uncased with pooler,
109,482,240; GPT-2 small with tied embeddings, 124,439,808). Compute times are
*not* measured: each tensor's backward time is its layer's backward FLOPs
(twice the forward FLOPs) divided by ``tflops`` effective TFLOP/s, forward time
is the forward FLOPs at the same rate. The default batch sizes and
``tflops=15`` (a V100-class GPU in mixed precision) are assumptions; profile
your own model on your own device with :func:`jaxcomp.perfmodel.profile`,
or name a decoder and a device (:mod:`jaxcomp.perfmodel.decoders`).
"""

from __future__ import annotations

import os

from jaxcomp.perfmodel import model_profile as _model_profile

__all__ = ["BUILTIN_PROFILES", "builtin_profile", "load_profile", "DEFAULT_TFLOPS"]

DEFAULT_TFLOPS = 15.0


def _conv_bn(out: list, batch: int):
  """``conv(cin, cout, k, hw_out)`` and ``bn(c, hw)``: each appends its
  gradient tensors' (elements, forward FLOPs) to ``out``."""

  def conv(cin, cout, k, hw_out):
    out.append((k * k * cin * cout, 2.0 * k * k * cin * cout * hw_out * hw_out * batch))

  def bn(c, hw):
    flops = 4.0 * c * hw * hw * batch
    out.append((c, flops / 2))  # scale
    out.append((c, flops / 2))  # bias

  return conv, bn


def _resnet50_layers(batch: int, image: int = 224):
  """(elements, forward FLOPs) per gradient tensor, forward order."""
  out = []
  conv, bn = _conv_bn(out, batch)
  hw = image // 2
  conv(3, 64, 7, hw)
  bn(64, hw)
  hw //= 2  # max pool
  cin = 64
  for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
    for b in range(blocks):
      stride = 2 if (b == 0 and stage > 0) else 1
      hw_out = hw // stride
      conv(cin, width, 1, hw)
      bn(width, hw)
      conv(width, width, 3, hw_out)
      bn(width, hw_out)
      conv(width, 4 * width, 1, hw_out)
      bn(4 * width, hw_out)
      if b == 0:
        conv(cin, 4 * width, 1, hw_out)
        bn(4 * width, hw_out)
      cin, hw = 4 * width, hw_out
  out.append((2048 * 1000, 2.0 * 2048 * 1000 * batch))
  out.append((1000, 1000.0 * batch))
  return out


def _resnet18_cifar_layers(batch: int, image: int = 32):
  """(elements, forward FLOPs) per gradient tensor, forward order: a 3x3
  stem without pooling, four stages of two basic blocks (64 to 512
  channels; a 1x1 projection where the shape changes), global average
  pooling and a 512x10 classifier."""
  out = []
  conv, bn = _conv_bn(out, batch)
  hw, cin = image, 64
  conv(3, 64, 3, hw)
  bn(64, hw)
  for stage, width in enumerate((64, 128, 256, 512)):
    for b in range(2):
      stride = 2 if (b == 0 and stage > 0) else 1
      hw_out = hw // stride
      conv(cin, width, 3, hw_out)
      bn(width, hw_out)
      conv(width, width, 3, hw_out)
      bn(width, hw_out)
      if stride != 1 or cin != width:
        conv(cin, width, 1, hw_out)
        bn(width, hw_out)
      cin, hw = width, hw_out
  out.append((512 * 10, 2.0 * 512 * 10 * batch))
  out.append((10, 10.0 * batch))
  return out


def _transformer_layers(*, vocab, positions, d, layers, seq, batch, ffn, token_types=0,
                        pooler=False, tied_head=False, fused_qkv=False):
  tokens = batch * seq
  out = []

  def dense(din, dout, bias=True):
    out.append((din * dout, 2.0 * din * dout * tokens))
    if bias:
      out.append((dout, 1.0 * dout * tokens))

  def ln():
    out.append((d, 4.0 * d * tokens))
    out.append((d, 4.0 * d * tokens))

  # Embedding gradients are dense in data-parallel training; a tied output
  # head puts its matmul on the embedding table.
  out.append((vocab * d, 2.0 * vocab * d * tokens if tied_head else d * tokens))
  out.append((positions * d, 1.0 * d * tokens))
  if token_types:
    out.append((token_types * d, 1.0 * d * tokens))
  pre_ln = tied_head  # GPT-2: pre-LN blocks and a final LN; BERT: post-LN
  if not pre_ln:
    ln()
  attn = 4.0 * seq * d * tokens  # QK^T and AV
  for _ in range(layers):
    if pre_ln:
      ln()
    if fused_qkv:
      dense(d, 3 * d)
    else:
      for _ in range(3):
        dense(d, d)
    out[-1] = (out[-1][0], out[-1][1] + attn)
    dense(d, d)
    ln()
    dense(d, ffn)
    dense(ffn, d)
    if not pre_ln:
      ln()
  if pre_ln:
    ln()
  if pooler:
    out.append((d * d, 2.0 * d * d * batch))
    out.append((d, 1.0 * d * batch))
  return out


_BUILDERS = {
    "resnet50": (lambda: _resnet50_layers(batch=64),
                 "ResNet-50 v1.5, ImageNet 224x224, batch 64 per worker"),
    "resnet18-cifar": (lambda: _resnet18_cifar_layers(batch=128),
                       "ResNet-18 (pytorch-cifar), CIFAR-10 32x32, batch 128 per worker"),
    "bert-base": (lambda: _transformer_layers(vocab=30522, positions=512, d=768, layers=12,
                                              seq=128, batch=32, ffn=3072, token_types=2,
                                              pooler=True),
                  "BERT-base uncased, sequence 128, batch 32 per worker"),
    "gpt2-small": (lambda: _transformer_layers(vocab=50257, positions=1024, d=768, layers=12,
                                               seq=1024, batch=8, ffn=3072, tied_head=True,
                                               fused_qkv=True),
                   "GPT-2 small (124M), sequence 1024, batch 8 per worker"),
}
BUILTIN_PROFILES = tuple(_BUILDERS)


def builtin_profile(name: str, *, tflops: float = DEFAULT_TFLOPS) -> _model_profile.ModelProfile:
  """A built-in profile with compute times at ``tflops`` effective TFLOP/s.

  Raises:
    ValueError: unknown name or ``tflops <= 0``.
  """
  if name not in _BUILDERS:
    raise ValueError(f"unknown profile {name!r}; built-in profiles are "
                     f"{', '.join(BUILTIN_PROFILES)} (or pass a JSON file saved by "
                     "jaxcomp.perfmodel.save_profile)")
  if not tflops > 0:
    raise ValueError(f"tflops must be > 0, got {tflops!r}")
  build, desc = _BUILDERS[name]
  layers = build()
  rate = tflops * 1e12
  return _model_profile.ModelProfile(
      name=name,
      layer_sizes=tuple(n for n, _ in layers),
      backward_times=tuple(2.0 * f / rate for _, f in layers),
      forward_time=sum(f for _, f in layers) / rate,
      meta={"description": desc, "sizes": "counted from the architecture",
            "timing": (f"derived: FLOP count at {tflops:g} effective TFLOP/s (assumed; "
                       "not measured)")})


def load_profile(name_or_path: str, *,
                 tflops: float = DEFAULT_TFLOPS) -> _model_profile.ModelProfile:
  """A built-in profile by name, or one saved as JSON by ``save_profile``.

  Raises:
    FileNotFoundError: a path (contains a separator or ends in .json) that does not exist.
    ValueError: neither a built-in name nor a profile file.
  """
  if name_or_path in _BUILDERS:
    return builtin_profile(name_or_path, tflops=tflops)
  looks_like_path = (os.sep in name_or_path or name_or_path.endswith(".json")
                     or os.path.exists(name_or_path))
  if looks_like_path:
    return _model_profile.load_profile_file(name_or_path)
  return builtin_profile(name_or_path)  # raises the "unknown profile" error
