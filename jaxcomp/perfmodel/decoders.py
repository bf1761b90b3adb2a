"""Profiles of decoder-only transformers by configuration, for ``jaxcomp
whatif --model NAME`` and ``--params N``: each gradient tensor's size in
backward order, and compute times from a FLOP count at a device's peak
times an assumed model FLOP utilization (MFU).

FLOPs per step (Chowdhery et al., *PaLM*, 2022, appendix B): ``6·N·T +
12·L·d·s·T`` for ``T`` tokens per worker, ``N`` the parameters that
multiply activations (every matrix but an untied input embedding, which is
a gather, and the learned positions), ``L`` layers of width ``d`` and
sequence length ``s`` (attention's ``QK^T`` and ``AV``, counted whole, not
halved for the causal mask). Forward is a third of it, backward two
thirds, per tensor; a layer's attention is put on its output projection.
Norm scales and biases cost ``4·n·T`` elementwise FLOPs each.

References:
  Radford et al., *Language Models are Unsupervised Multitask Learners*,
  2019, and the configs of ``openai-community/gpt2``, ``gpt2-medium``,
  ``gpt2-large``, ``gpt2-xl`` on Hugging Face (layers, width, heads,
  vocabulary 50,257, 1,024 positions);
  Meta, *Llama 3.2* model cards and ``config.json`` of
  ``meta-llama/Llama-3.2-1B`` and ``-3B`` (tied embeddings) and *Llama 3.1*
  of ``meta-llama/Llama-3.1-8B`` and ``-70B`` (layers, width, heads,
  key-value heads, FFN width, vocabulary 128,256); Grattafiori et al.,
  *The Llama 3 Herd of Models*, 2024 (sequence length 8,192 in
  pre-training).
"""

from __future__ import annotations

import dataclasses
import math

from jaxcomp.perfmodel import hardware
from jaxcomp.perfmodel import model_profile as _model_profile

__all__ = ["DecoderConfig", "DECODERS", "DEFAULT_MFU", "DEFAULT_TOKENS_PER_STEP",
           "decoder_config", "config_from_params", "decoder_layers", "decoder_profile"]

DEFAULT_MFU = 0.4
DEFAULT_TOKENS_PER_STEP = 8192


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """A decoder-only transformer's shape.

  Attributes:
    name: label.
    layers: transformer blocks ``L``.
    d_model: width ``d``.
    heads: attention heads.
    kv_heads: key-value heads (grouped-query attention; ``heads`` for
      multi-head attention).
    ffn: hidden width of the MLP.
    vocab: vocabulary size.
    seq_len: default sequence length ``s``.
    style: ``"gpt2"`` (LayerNorm with bias, biases everywhere, learned
      positions, fused QKV, GELU MLP, tied head) or ``"llama"`` (RMSNorm,
      no biases, rotary positions, SwiGLU MLP).
    tied: whether the output head is the input embedding.
    source: where the numbers come from.
  """

  name: str
  layers: int
  d_model: int
  heads: int
  kv_heads: int
  ffn: int
  vocab: int
  seq_len: int
  style: str = "llama"
  tied: bool = False
  source: str = ""

  @property
  def num_params(self) -> int:
    return sum(n for n, _ in decoder_layers(self, tokens=1, seq_len=1))


_GPT2 = "Radford et al. 2019; Hugging Face config openai-community/{}"
_LLAMA = "Meta Llama {} model card and config.json of meta-llama/{}"
DECODERS: dict[str, DecoderConfig] = {c.name: c for c in (
    DecoderConfig("gpt2-small", 12, 768, 12, 12, 3072, 50257, 1024, "gpt2", True,
                  _GPT2.format("gpt2")),
    DecoderConfig("gpt2-medium", 24, 1024, 16, 16, 4096, 50257, 1024, "gpt2", True,
                  _GPT2.format("gpt2-medium")),
    DecoderConfig("gpt2-large", 36, 1280, 20, 20, 5120, 50257, 1024, "gpt2", True,
                  _GPT2.format("gpt2-large")),
    DecoderConfig("gpt2-xl", 48, 1600, 25, 25, 6400, 50257, 1024, "gpt2", True,
                  _GPT2.format("gpt2-xl")),
    DecoderConfig("llama-3.2-1b", 16, 2048, 32, 8, 8192, 128256, 8192, "llama", True,
                  _LLAMA.format("3.2", "Llama-3.2-1B")),
    DecoderConfig("llama-3.2-3b", 28, 3072, 24, 8, 8192, 128256, 8192, "llama", True,
                  _LLAMA.format("3.2", "Llama-3.2-3B")),
    DecoderConfig("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, 8192, "llama", False,
                  _LLAMA.format("3.1", "Llama-3.1-8B")),
    DecoderConfig("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, 8192, "llama", False,
                  _LLAMA.format("3.1", "Llama-3.1-70B")),
)}


def decoder_config(name: str) -> DecoderConfig:
  """The preset ``name``.

  Raises:
    ValueError: no such preset; the message lists them.
  """
  if name not in DECODERS:
    raise ValueError(f"unknown model {name!r}; presets are {', '.join(DECODERS)} "
                     "(or --params N)")
  return DECODERS[name]


def decoder_layers(cfg: DecoderConfig, *, tokens: int, seq_len: int
                   ) -> list[tuple[int, float]]:
  """``(elements, forward FLOPs)`` of each gradient tensor, forward order."""
  d, t = cfg.d_model, tokens
  head_dim = d // cfg.heads
  kv = cfg.kv_heads * head_dim
  gpt2 = cfg.style == "gpt2"
  out: list[tuple[int, float]] = []

  def matrix(din, dout, bias=gpt2):
    out.append((din * dout, 2.0 * din * dout * t))
    if bias:
      out.append((dout, 1.0 * dout * t))

  def norm():
    out.append((d, 4.0 * d * t))
    if gpt2:
      out.append((d, 4.0 * d * t))

  out.append((cfg.vocab * d, 2.0 * cfg.vocab * d * t if cfg.tied else 0.0))
  if gpt2:
    out.append((1024 * d, 0.0))  # learned positions: a gather
  attention = 4.0 * d * seq_len * t
  for _ in range(cfg.layers):
    norm()
    if gpt2:
      matrix(d, 3 * d)
    else:
      matrix(d, d)
      matrix(d, kv)
      matrix(d, kv)
    matrix(d, d)
    k = len(out) - (2 if gpt2 else 1)  # the output projection's weight
    out[k] = (out[k][0], out[k][1] + attention)
    norm()
    if not gpt2:
      matrix(d, cfg.ffn)  # gate
    matrix(d, cfg.ffn)
    matrix(cfg.ffn, d)
  norm()
  if not cfg.tied:
    matrix(d, cfg.vocab, bias=False)
  return out


def _per_layer(d: int, vocab: int) -> tuple[int, int]:
  """Parameters of one block of :func:`config_from_params`' shape, and its heads."""
  heads = max(1, d // 128) if d >= 512 else max(1, d // 64)
  kv = max(1, heads // 4) * (d // heads)
  del vocab
  return 2 * d * d + 2 * d * kv + 3 * d * 4 * d + 2 * d, heads


def config_from_params(num_params: float, *, layers: int | None = None,
                       d_model: int | None = None, vocab: int = 128256,
                       seq_len: int = 8192) -> DecoderConfig:
  """A Llama-style decoder of about ``num_params`` parameters.

  The shape is Llama 3.2 1B's: RMSNorm, SwiGLU MLP of width ``4·d``, heads
  of 128 (64 below ``d = 512``), a quarter as many key-value heads, tied
  embeddings of ``vocab`` rows. Unless given, ``d_model`` (a multiple of
  128) and ``layers`` are chosen so that ``d / L`` is nearest 128, Llama
  3's ratio (2048/16, 4096/32), and the count nearest ``num_params``.

  Raises:
    ValueError: ``num_params`` not > 0, or too small for the embedding of
      ``vocab`` rows (pass a smaller ``vocab``), or ``layers`` / ``d_model``
      not >= 1.
  """
  if not (math.isfinite(num_params) and num_params > 0):
    raise ValueError(f"--params must be > 0, got {num_params!r}")
  for what, v in (("layers", layers), ("d_model", d_model)):
    if v is not None and v < 1:
      raise ValueError(f"{what} must be >= 1, got {v}")

  def blocks(d):
    return (num_params - vocab * d - d) / _per_layer(d, vocab)[0]

  if d_model is None:
    widths = [d for d in range(128, 65537, 128) if blocks(d) >= 0.5]
    if not widths:
      raise ValueError(f"{num_params:.3g} parameters do not cover the embedding of a "
                       f"vocabulary of {vocab} at width 128: pass a smaller --vocab")
    if layers is None:
      d_model = min(widths, key=lambda d: abs(math.log(d / max(1, round(blocks(d))) / 128)))
    else:
      want = layers
      d_model = min(widths, key=lambda d: abs(blocks(d) - want))
  if layers is None:
    layers = max(1, round(blocks(d_model)))
  heads = _per_layer(d_model, vocab)[1]
  return DecoderConfig(
      f"decoder-{num_params:.3g}", layers, d_model, heads, max(1, heads // 4), 4 * d_model,
      vocab, seq_len, "llama", True,
      f"derived from --params {num_params:.4g}: Llama-3.2-1B-style shape, d/L near 128")


def decoder_profile(cfg: DecoderConfig, device: hardware.DevicePreset, *,
                    mfu: float = DEFAULT_MFU,
                    tokens_per_step: int = DEFAULT_TOKENS_PER_STEP,
                    seq_len: int | None = None) -> _model_profile.ModelProfile:
  """The profile of ``cfg`` trained on ``device``: tensor sizes counted,
  compute derived from FLOPs at ``device.peak_bf16_tflops * mfu``.

  Args:
    cfg: the model.
    device: the device each worker is.
    mfu: model FLOP utilization in (0, 1] (assumed; default 0.4).
    tokens_per_step: tokens each worker processes per step (assumed;
      default 8,192).
    seq_len: sequence length (default ``cfg.seq_len``).

  Returns:
    A :class:`ModelProfile` whose ``meta`` says how each number was made.

  Raises:
    ValueError: ``mfu`` not in (0, 1], or ``tokens_per_step`` or
      ``seq_len`` not >= 1.
  """
  if not 0 < mfu <= 1:
    raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
  s = cfg.seq_len if seq_len is None else seq_len
  if tokens_per_step < 1 or s < 1:
    raise ValueError(f"tokens_per_step and seq_len must be >= 1, got "
                     f"{tokens_per_step=}, {s=}")
  layers = decoder_layers(cfg, tokens=tokens_per_step, seq_len=s)
  rate = device.peak_bf16_tflops * 1e12 * mfu
  flops = 3.0 * sum(f for _, f in layers)
  return _model_profile.ModelProfile(
      name=cfg.name,
      layer_sizes=tuple(n for n, _ in layers),
      backward_times=tuple(2.0 * f / rate for _, f in layers),
      forward_time=sum(f for _, f in layers) / rate,
      meta={"description": (f"{cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads "
                            f"({cfg.kv_heads} key-value), FFN {cfg.ffn}, vocabulary "
                            f"{cfg.vocab}"),
            "sizes": f"counted from the configuration ({cfg.source})",
            "timing": (f"derived: {flops:.3g} FLOPs (6·N·T + 12·L·d·s·T, T = "
                       f"{tokens_per_step} tokens/worker, s = {s}) at {device.name} peak "
                       f"{device.peak_bf16_tflops:g} bf16 TFLOP/s "
                       f"({'assumed' if device.assumed else 'datasheet'}) x MFU "
                       f"{mfu:g} (assumed)"),
            "device": device.name, "tokens_per_step": tokens_per_step, "seq_len": s,
            "mfu": mfu})
