"""What ``jaxcomp whatif`` asks the model and how it labels the answer.

Every input figure is *measured* (timed on a device, by jaxcomp or in the
committed kernel tables), *derived* (computed from other figures: FLOP
counts at a peak, the alpha-beta model) or *assumed* (a default the user
may change), and the output says which, with its source. This module
turns the command's choices into a profile (:func:`whatif_profile`), the
target device (:func:`target_device`) and encode/decode costs
(:func:`codec_costs`), and states each compressor's break-even bandwidth
(:func:`break_even`) and the speedup-against-bandwidth plot
(:func:`plot_speedup`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any
from collections.abc import Mapping, Sequence

from jaxcomp.perfmodel import codec as _codec
from jaxcomp.perfmodel import costs
from jaxcomp.perfmodel import decoders
from jaxcomp.perfmodel import hardware
from jaxcomp.perfmodel import kernel_table
from jaxcomp.perfmodel import model_profile as _model_profile
from jaxcomp.perfmodel import prediction as _prediction
from jaxcomp.perfmodel import pricing as _pricing
from jaxcomp.perfmodel import profiles as _profiles
from jaxcomp.perfmodel import simulate

__all__ = ["whatif_profile", "target_device", "device_line", "codec_costs", "profile_label", "break_even",
           "break_even_line", "verdicts", "plot_speedup", "BANDWIDTHS"]

# The plot's bandwidths (Gbit/s), and the decades a break-even is bracketed by.
BANDWIDTHS = tuple(0.01 * 10 ** (i / 3) for i in range(0, 22))  # 0.01 .. 1e5
DECADES = tuple(0.01 * 10 ** i for i in range(8))


def whatif_profile(*, profile: str | None = None, model: str | None = None,
                   params: float | None = None, layers: int | None = None,
                   d_model: int | None = None, vocab: int | None = None,
                   seq_len: int | None = None, tokens_per_step: int | None = None,
                   device: hardware.DevicePreset | None = None, mfu: float | None = None,
                   tflops: float | None = None) -> _model_profile.ModelProfile:
  """The profile ``jaxcomp whatif`` prices.

  Args:
    profile: a built-in profile's name or a file of :func:`save_profile`.
    model: a decoder preset of :data:`jaxcomp.perfmodel.decoders.DECODERS`.
    params: parameters of a Llama-style decoder (``layers``, ``d_model``,
      ``vocab`` optional).
    layers, d_model, vocab: with ``params`` only.
    seq_len, tokens_per_step: with ``model`` or ``params`` only.
    device: the device each worker is; needed by ``model`` and ``params``.
    mfu: model FLOP utilization (default 0.4, assumed).
    tflops: effective TFLOP/s of a built-in profile (default: ``device``'s
      peak times ``mfu``, else 15, assumed).

  Raises:
    ValueError: more than one of ``profile``, ``model``, ``params``; a
      decoder without a device; an option that its route does not take.
  """
  routes = [r for r, v in (("--profile", profile), ("--model", model), ("--params", params))
            if v is not None]
  if len(routes) > 1:
    raise ValueError(f"pass one of --profile, --model, --params, not {' and '.join(routes)}")
  decoder = model is not None or params is not None
  for flag, v, ok, route in (("--layers", layers, params is not None, "--params"),
                             ("--d-model", d_model, params is not None, "--params"),
                             ("--vocab", vocab, params is not None, "--params"),
                             ("--seq-len", seq_len, decoder, "--model or --params"),
                             ("--tokens-per-step", tokens_per_step, decoder,
                              "--model or --params")):
    if v is not None and not ok:
      raise ValueError(f"{flag} applies to {route}")
  mfu_ = decoders.DEFAULT_MFU if mfu is None else mfu
  if not 0 < mfu_ <= 1:
    raise ValueError(f"--mfu must be in (0, 1], got {mfu_:g}")
  if decoder:
    if device is None:
      raise ValueError("--model and --params count FLOPs at a device's peak: pass --device "
                       f"({', '.join(hardware.DEVICES)})")
    if model is not None:
      cfg = decoders.decoder_config(model)
    else:
      assert params is not None
      cfg = decoders.config_from_params(params, layers=layers, d_model=d_model,
                                        **({} if vocab is None else {"vocab": vocab}))
    return decoders.decoder_profile(
        cfg, device, mfu=mfu_, seq_len=seq_len,
        tokens_per_step=decoders.DEFAULT_TOKENS_PER_STEP if tokens_per_step is None
        else tokens_per_step)
  name = "resnet50" if profile is None else profile
  if name not in _profiles.BUILTIN_PROFILES:
    return _profiles.load_profile(name)
  if tflops is not None or device is None:
    return _profiles.builtin_profile(name, tflops=tflops or _profiles.DEFAULT_TFLOPS)
  rate = device.peak_bf16_tflops * mfu_
  prof = _profiles.builtin_profile(name, tflops=rate)
  return dataclasses.replace(prof, meta={
      **prof.meta, "device": device.name,
      "timing": (f"derived: FLOP count at {device.name} peak {device.peak_bf16_tflops:g} bf16 "
                 f"TFLOP/s ({'assumed' if device.assumed else 'datasheet'}) x MFU {mfu_:g} "
                 "(assumed)")})


def profile_label(profile: _model_profile.ModelProfile) -> str:
  """How the profile's compute times were obtained, as its ``meta`` says."""
  timing = profile.meta.get("timing")
  if not timing:
    return ("given: the profile does not say how its times were obtained "
            "(not measured by jaxcomp.perfmodel.profile)")
  return str(timing)


def device_line(target: hardware.DevicePreset | None, source: str,
                profile: _model_profile.ModelProfile, *, shards: int = 1) -> str:
  """The target device, its figures and their source, whether the
  profile's compute was timed on another device, and whether the model's
  training state fits in its memory: 16 bytes per parameter (Adam in mixed
  precision: bfloat16 weights and gradients, float32 master weights and two
  moments; Rajbhandari et al., *ZeRO*, 2020), divided by ``shards`` (FSDP),
  activations not counted."""
  if target is None:
    return ("device: not named (pass --device: " + ", ".join(hardware.DEVICES)
            + "); compute as the profile states it")
  line = (f"device: {target.name} ({target.description}, from {source}): "
          f"{target.peak_bf16_tflops:g} bf16 / {target.peak_fp32_tflops:g} fp32 TFLOP/s peak, "
          f"{target.hbm_gbytes_per_s:g} GB/s memory, {target.intra_gbps:g} Gbit/s inside a "
          f"node ({target.label})")
  recorded = str(profile.meta.get("device", ""))
  if recorded and recorded != target.name:
    platform, _, kind = recorded.partition(":")
    if hardware.preset_of_kind(platform, kind) is not target:
      line += (f"; note: the profile's compute was timed on {recorded}, not rescaled to "
               f"{target.name}")
  need = 16.0 * profile.num_params / shards / 1e9
  if need > target.memory_gbytes:
    per = f" / {shards} shards" if shards > 1 else ""
    line += (f"\n  note: Adam's state of {profile.num_params / 1e9:.3g}B parameters needs "
             f"~{need:.0f} GB per worker (16 bytes each{per}), "
             f"more than the {target.memory_gbytes:g} GB of one {target.name}: shard it "
             "(--sharding fsdp) or split it (--tensor-parallel)")
  return line


def target_device(device: str | None, profile: _model_profile.ModelProfile
                  ) -> tuple[hardware.DevicePreset | None, str]:
  """The device the workers are, and where that comes from: ``--device``,
  else the device the profile records (its ``meta["device"]``), else none.
  """
  if device is not None:
    return hardware.device_preset(device), "--device"
  recorded = str(profile.meta.get("device", ""))
  if recorded in hardware.DEVICES:
    return hardware.DEVICES[recorded], "the profile"
  platform, _, kind = recorded.partition(":")
  found = hardware.preset_of_kind(platform, kind) if recorded else None
  return found, ("the profile's device " + recorded) if found else "none"


def _measure(comps, target) -> tuple[dict, list[str]]:
  at_hand, desc = hardware.device_at_hand()
  if target is not None and (at_hand is None or at_hand.name != target.name):
    raise ValueError(
        f"--codec measure times the device at hand ({desc}), but the target device is "
        f"{target.name} ({target.description}): run it on a {target.name}, or use "
        "--codec auto (kernel tables for a GPU) or --codec none")
  codecs = {name: _codec.measure_codec(c) for name, c in comps.items()}
  return codecs, [f"encode/decode: measured on this machine ({desc}), affine fit in size"]


def codec_costs(spec: str, comps: Mapping[str, Any], target: hardware.DevicePreset | None
                ) -> tuple[dict[str, _pricing.CodecCost], list[str]]:
  """Encode/decode costs of ``comps`` and the lines that label them.

  Args:
    spec: ``"auto"`` (a GPU target: the kernel tables,
      :func:`jaxcomp.perfmodel.kernel_table.gpu_codec`; a CPU target: timed
      here; no target: not counted), ``"measure"`` (timed on the device at
      hand), ``"none"`` or a JSON file ``{spec: CodecCost fields}``.
    comps: the compressors by their spec.
    target: the device the workers are, or None.

  Raises:
    ValueError: ``"measure"`` (or ``"auto"`` for a CPU target) where the
      device at hand is not ``target``, naming both; a file without an
      entry for a compressor.
    FileNotFoundError: no such file.
  """
  if spec == "none":
    return {}, ["encode/decode: not counted (--codec none: the best case for compression)"]
  if spec == "measure" or (spec == "auto" and target is not None and not target.gpu):
    return _measure(comps, target)
  if spec == "auto" and target is None:
    return {}, ["encode/decode: not counted (assumed free): no target device; pass --device "
                f"({', '.join(hardware.DEVICES)}) or --codec measure to time this machine"]
  if spec == "auto":
    assert target is not None
    lines = [f"encode/decode on {target.name}: from the kernel tables of "
             f"{kernel_table.TABLE_SOURCE}, shipped in jaxcomp.perfmodel.kernel_table"]
    codecs = {}
    for name, c in comps.items():
      codecs[name], how = kernel_table.gpu_codec(c, target)
      lines.append(f"  {name}: {how}")
    return codecs, lines
  if not os.path.isfile(spec):
    raise FileNotFoundError(f"codec file {spec!r} does not exist "
                            "(--codec takes 'auto', 'measure', 'none' or a JSON file)")
  with open(spec) as f:
    d = json.load(f)
  missing = [n for n in comps if n not in d]
  if missing:
    raise ValueError(f"codec file {spec!r} has no entry for {missing}")
  return ({n: _pricing.CodecCost.from_dict(d[n]) for n in comps},
          [f"encode/decode: from {spec} (given)"])


def _speedup(profile, compressor, network, gbps, codec, kw) -> float:
  net = network.with_link(costs.Link.from_bandwidth(gbps, network.link.alpha))
  res = _prediction.compare(profile, {"c": compressor}, net,
                            codecs={} if codec is None else {"c": codec}, **kw)
  return res["c"].speedup


def break_even(profile: _model_profile.ModelProfile, compressor, network: costs.Network, *,
               codec: _pricing.CodecCost | None = None,
               sweep: Mapping[float, float] | None = None, **kw) -> tuple[str, float]:
  """Where ``compressor`` stops (or starts) paying, over the link's bandwidth.

  Args:
    profile, compressor, network: as for :func:`predict`.
    codec: its encode/decode cost.
    sweep: ``{gbps: speedup}`` over ``DECADES`` (or finer), if made.
    **kw: :func:`compare`'s options (buckets, overlap, ...).

  Returns:
    ``("below", g)``: pays below ``g`` Gbit/s; ``("above", g)``: pays
    above; ``("always", inf)`` / ``("never", 0)`` over 0.01 Gbit/s to 100
    Tbit/s. The crossing is bisected 5 times inside its bracket, then
    interpolated in log speedup against log bandwidth.
  """
  if sweep is None:
    sweep = {g: _speedup(profile, compressor, network, g, codec, kw) for g in DECADES}
  gs = sorted(sweep)
  pays = [sweep[g] >= 1.0 for g in gs]
  if all(pays):
    return "always", math.inf
  if not any(pays):
    return "never", 0.0
  i = next(k for k in range(1, len(gs)) if pays[k] != pays[k - 1])
  (lo, s_lo), (hi, s_hi), first = (gs[i - 1], sweep[gs[i - 1]]), (gs[i], sweep[gs[i]]), pays[i - 1]
  for _ in range(5):
    mid = math.sqrt(lo * hi)
    s_mid = _speedup(profile, compressor, network, mid, codec, kw)
    if (s_mid >= 1.0) == first:
      lo, s_lo = mid, s_mid
    else:
      hi, s_hi = mid, s_mid
  w = math.log(s_lo) / (math.log(s_lo) - math.log(s_hi)) if s_lo != s_hi else 0.5
  return ("below" if first else "above"), lo * (hi / lo) ** w


def break_even_line(name: str, verdict: tuple[str, Any], gbps: float, speedup: float) -> str:
  """``"int8_block pays below 180 Gbit/s (at your 25 Gbit/s: 2.31x)"``."""
  kind, g = verdict
  if kind == "error":
    return f"  {name}: no break-even: the model cannot price it at every bandwidth ({g})"
  at = f"{g:,.0f}" if kind in ("below", "above") and g >= 100 else f"{g:.3g}"
  where = {"below": f"pays below {at} Gbit/s", "above": f"pays above {at} Gbit/s",
           "always": "pays at every bandwidth from 0.01 Gbit/s to 100 Tbit/s",
           "never": "never pays between 0.01 Gbit/s and 100 Tbit/s"}[kind]
  return f"  {name} {where} (at your {gbps:g} Gbit/s: {speedup:.2f}x)"


def plot_speedup(path: str | os.PathLike, sweep: Mapping[float, Mapping[str, Any]],
                 names: Sequence[str], *, gbps: float, title: str,
                 verdicts: Mapping[str, tuple[str, float]] | None = None) -> None:
  """Writes speedup over dense against bandwidth as a PNG, the user's
  bandwidth marked with a vertical line and each break-even with a dot.

  Args:
    path: the PNG.
    sweep: :func:`sweep_bandwidth`'s result.
    names: the compressors to draw.
    gbps: the user's bandwidth, Gbit/s.
    title: the plot's title.
    verdicts: :func:`break_even` of each name.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  xs = sorted(sweep)
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name in names:
    line, = ax.plot(xs, [sweep[g][name].speedup for g in xs], label=name)
    if name not in sweep[xs[0]]:
      continue
    kind, g = (verdicts or {}).get(name, ("never", 0.0))
    if kind in ("below", "above"):
      ax.plot([g], [1.0], "o", color=line.get_color(), ms=5)
  ax.axhline(1.0, color="k", lw=0.8, ls="--", label="dense")
  ax.axvline(gbps, color="tab:red", lw=1.2, ls=":", label=f"your link: {gbps:g} Gbit/s")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("bandwidth per worker (Gbit/s)")
  ax.set_ylabel("predicted speedup over dense")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def verdicts(profile, comps: Mapping[str, Any], network: costs.Network, *,
             gbps: Sequence[float] = DECADES, **kw) -> tuple[dict, dict]:
  """A bandwidth sweep (``{gbps: compare(...)}``) and each compressor's
  :func:`break_even` (or ``("error", 0)`` where the model cannot price it,
  e.g. a merged bucket beyond its largest buffer), for :func:`compare`'s
  options ``kw`` (``codecs``, ``buckets``, ...)."""
  codecs = dict(kw.pop("codecs", None) or {})
  sweep: dict = {g: {} for g in gbps}
  out: dict = {}
  for name, c in comps.items():
    try:
      one = simulate.sweep_bandwidth(profile, {name: c}, network, gbps, codecs=codecs, **kw)
      out[name] = break_even(profile, c, network, codec=codecs.get(name),
                             sweep={g: one[g][name].speedup for g in one}, **kw)
    except (ValueError, OverflowError) as e:
      out[name] = ("error", str(e).splitlines()[0])
      continue
    for g in gbps:
      sweep[g].update(one[g])
  return sweep, out
