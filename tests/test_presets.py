"""`jaxcomp whatif` for a model and cluster the user names: decoder, device
and network presets, GPU codec costs from the shipped kernel rows, labels,
break-even bandwidths and the refusal to time the wrong device."""

import math
import re

import jax.numpy as jnp
import pytest

from jaxcomp import cli
from jaxcomp import compressors
from jaxcomp import perfmodel as pm
from jaxcomp.compressors import base
from jaxcomp.perfmodel import decoders
from jaxcomp.perfmodel import kernel_table
from jaxcomp.perfmodel import verdict


@pytest.fixture
def no_timing(monkeypatch):
  """Fails a test that would time encode/decode on this machine."""
  def refuse(*args, **kwargs):
    raise AssertionError("the CPU was timed")
  monkeypatch.setattr(pm.codec, "measure_codec", refuse)
  monkeypatch.setattr(verdict._codec, "measure_codec", refuse)


# Published parameter counts: GPT-2 (Hugging Face configs; 124M, 355M,
# 774M, 1.5B), Llama 3.2 1B / 3B and Llama 3.1 8B / 70B (model cards:
# 1.24B, 3.21B, 8.03B, 70.6B).
@pytest.mark.parametrize("name, params", [
    ("gpt2-small", 124_439_808), ("gpt2-medium", 354_823_168),
    ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200),
    ("llama-3.2-1b", 1.236e9), ("llama-3.2-3b", 3.213e9),
    ("llama-3.1-8b", 8.030e9), ("llama-3.1-70b", 70.554e9)])
def test_decoder_presets_count_the_published_parameters(name, params):
  cfg = pm.DECODERS[name]
  assert cfg.num_params == pytest.approx(params, rel=5e-4)
  assert cfg.source  # every preset cites its config


def test_gpt2_small_preset_is_the_builtin_profile():
  """The same tensors, in the same order, as the exact built-in profile."""
  prof = pm.decoder_profile(pm.DECODERS["gpt2-small"], pm.DEVICES["h100"])
  assert prof.layer_sizes == pm.builtin_profile("gpt2-small").layer_sizes


def test_decoder_flops_are_6NT_plus_attention():
  """6·N·T over the matrices + 12·L·d·s·T, at the peak times the MFU."""
  cfg, dev = pm.DECODERS["llama-3.2-1b"], pm.DEVICES["h100"]
  t, s = 4096, 2048
  prof = pm.decoder_profile(cfg, dev, mfu=0.5, tokens_per_step=t, seq_len=s)
  layers = decoders.decoder_layers(cfg, tokens=t, seq_len=s)
  d = cfg.d_model
  matrices = sum(n for n, f in layers if n > d and f > 0)  # the tied embedding is the head
  vectors = sum(f for n, f in layers if n <= d)  # RMSNorm scales: 4·d·T each
  flops = 6 * matrices * t + 12 * cfg.layers * cfg.d_model * s * t + 3 * vectors
  assert prof.compute_time == pytest.approx(flops / (989e12 * 0.5), rel=1e-9)
  assert prof.backward_time == pytest.approx(2 * prof.forward_time)
  assert prof.meta["timing"].startswith("derived:") and "MFU 0.5 (assumed)" in (
      prof.meta["timing"])


@pytest.mark.parametrize("n", [1.1e9, 3e8, 7e9, 7e10])
def test_config_from_params_lands_near_the_count(n):
  cfg = pm.config_from_params(n)
  assert cfg.num_params == pytest.approx(n, rel=0.08)
  assert 40 <= cfg.d_model / cfg.layers <= 400
  fixed = pm.config_from_params(n, layers=24)
  assert fixed.layers == 24 and fixed.num_params == pytest.approx(n, rel=0.15)
  with pytest.raises(ValueError, match="smaller --vocab"):
    pm.config_from_params(1e6)


def test_kernel_table_prices_gpus_by_memory_bandwidth():
  c = compressors.get("int8_block")
  h200, h200_how = kernel_table.gpu_codec(c, pm.DEVICES["h200"])
  h100, h100_how = kernel_table.gpu_codec(c, pm.DEVICES["h100"])
  # At 1e8 elements the H200 line is its measured rows' (0.253 ms).
  assert h200.encode(100_000_000) == pytest.approx(0.253e-3, rel=0.05)
  assert h100.encode(10 ** 8) == pytest.approx(h200.encode(10 ** 8) * 4800 / 3350)
  assert "measured" in h200_how and "x1.43 for h100" in h100_how
  bf16, how = kernel_table.gpu_codec(compressors.get("bf16"), pm.DEVICES["a100"])
  assert "encode derived" in how and bf16.encode(10 ** 8) > 0
  with pytest.raises(ValueError, match="for GPUs"):
    kernel_table.gpu_codec(c, pm.DEVICES["cpu"])


@pytest.mark.parametrize("spec", ["int8_block", "int8_block:bits=4", "qsgd",
                                  "qsgd:levels=3,bucket_size=77"])
def test_quantizers_payload_arrays_by_formula_are_the_traced_ones(spec):
  name, kwargs = cli.parse_compressor_spec(spec)
  c = compressors.get(name, **kwargs)
  for n in (1, 5, 1000, 1001, 4097, 65537):
    assert c.payload_arrays(n) == base._payload_arrays(c, n, jnp.float32)


def _lines(out):
  return out.splitlines()


def test_whatif_llama_on_h100_labels_every_figure_without_timing(no_timing, capsys):
  assert cli.main(["whatif", "--model", "llama-3.2-1b", "--device", "h100",
                   "-p", "16", "-b", "25"]) == 0
  out = capsys.readouterr().out
  assert "profile llama-3.2-1b: 1235.8M parameters" in out
  assert "compute " in out and "derived:" in out and "MFU 0.4 (assumed)" in out
  assert "device: h100" in out and "datasheet" in out
  assert "25 Gbit/s (given)" in out and "50 us per message (assumed default)" in out
  assert "kernel tables of benchmarks/results/nvidia-h200-2026-11-28" in out
  assert "predicted (derived" in out
  # Every compressor has a break-even bandwidth and its speedup at 25 Gbit/s.
  for spec in cli.DEFAULT_COMPRESSORS:
    assert re.search(rf"^  {re.escape(spec)} pays below [\d,.]+ Gbit/s \(at your 25 Gbit/s",
                     out, re.M), spec


def test_whatif_params_on_h100(no_timing, capsys):
  assert cli.main(["whatif", "--params", "1.1e9", "--device", "h100", "-p", "16",
                   "-b", "25", "-c", "int8_block"]) == 0
  out = capsys.readouterr().out
  m = re.search(r"^profile decoder-1\.1e\+09: ([\d.]+)M parameters", out, re.M)
  assert m and float(m.group(1)) == pytest.approx(1100, rel=0.08)
  assert "derived from --params 1.1e+09" in out and "int8_block pays below" in out


def test_whatif_measure_refuses_another_device(capsys):
  """On this CPU machine, --codec measure cannot time an H100."""
  with pytest.raises(SystemExit) as e:
    cli.main(["whatif", "--device", "h100", "--codec", "measure"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--codec measure times the device at hand (cpu:cpu)" in err
  assert "target device is h100" in err


def test_whatif_without_a_device_does_not_time_the_cpu(no_timing, capsys):
  assert cli.main(["whatif", "-c", "bf16"]) == 0
  out = capsys.readouterr().out
  assert "encode/decode: not counted (assumed free): no target device" in out
  assert "device: not named" in out


def test_whatif_network_preset_and_device_nvlink(no_timing, capsys):
  assert cli.main(["whatif", "--model", "gpt2-small", "--device", "a100", "--network",
                   "ib-hdr", "--algorithm", "hierarchical", "-c", "bf16"]) == 0
  out = capsys.readouterr().out
  assert "200 Gbit/s (ib-hdr: NVIDIA ConnectX-6 datasheet)" in out
  assert "5 us per message (assumed for InfiniBand HDR" in out
  assert "2400 Gbit/s inside: a100 NVLink" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "llama-3.2-1b"], "pass --device"),
    (["--model", "llama-9", "--device", "h100"], "unknown model 'llama-9'"),
    (["--model", "gpt2-small", "--params", "1e9", "--device", "h100"],
     "pass one of --profile, --model, --params"),
    (["--layers", "4"], "--layers applies to --params"),
    (["--seq-len", "128"], "--seq-len applies to --model or --params"),
    (["--params", "1e9", "--device", "h100", "--mfu", "2"], "mfu must be in (0, 1]"),
])
def test_whatif_preset_bad_input(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["whatif", "--codec", "none", *argv])
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_whatif_reads_the_device_a_saved_profile_records(tmp_path, no_timing, capsys):
  prof = pm.ModelProfile("mine", [1000, 200_000], [1e-3, 2e-3], 1e-3,
                         meta={"device": "gpu:NVIDIA H100 80GB HBM3", "timing": "measured: x"})
  path = tmp_path / "mine.json"
  pm.save_profile(prof, path)
  assert cli.main(["whatif", "--profile", str(path), "-c", "bf16"]) == 0
  out = capsys.readouterr().out
  assert "device: h100" in out and "from the profile's device gpu:NVIDIA H100" in out
  assert "encode/decode on h100" in out
  hand = tmp_path / "hand.json"
  pm.save_profile(pm.ModelProfile("hand", [1000], [1e-3], 1e-3), hand)
  cli.main(["whatif", "--profile", str(hand), "-c", "bf16", "--device", "h100"])
  assert "given: the profile does not say how its times were obtained" in (
      capsys.readouterr().out)


def test_break_even_brackets_the_crossing():
  prof = pm.decoder_profile(pm.DECODERS["gpt2-small"], pm.DEVICES["h100"])
  net = pm.Network(16, pm.Link.from_bandwidth(10, 50e-6))
  c = compressors.get("bf16")
  codec, _ = pm.gpu_codec(c, pm.DEVICES["h100"])
  kind, g = pm.break_even(prof, c, net, codec=codec, buckets="layer")
  assert kind == "below" and 1 < g < 1e5
  for gbps, pays in ((g / 1.5, True), (g * 1.5, False)):
    res = pm.compare(prof, {"c": c}, net.with_link(pm.Link.from_bandwidth(gbps, 50e-6)),
                     codecs={"c": codec}, buckets="layer")
    assert (res["c"].speedup >= 1) == pays
  free = pm.IdealCompressor(100.0)
  assert pm.break_even(prof, free, net, buckets="layer")[0] in ("below", "always")
  assert not math.isnan(g)


def test_whatif_plot_marks_the_users_bandwidth(tmp_path, no_timing, capsys, monkeypatch):
  seen = {}
  real = verdict.plot_speedup

  def spy(path, sweep, names, **kw):
    seen.update(kw)
    return real(path, sweep, names, **kw)

  monkeypatch.setattr(verdict, "plot_speedup", spy)
  png = tmp_path / "p.png"
  assert cli.main(["whatif", "--model", "gpt2-small", "--device", "h100", "-b", "25",
                   "-c", "bf16", "--plot", str(png)]) == 0
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert seen["gbps"] == 25 and seen["verdicts"]["bf16"][0] == "below"


def test_profile_takes_a_train_state_and_whatif_reads_its_file(tmp_path, capsys):
  """A built step's state is profiled through its loss; the saved profile
  names this CPU, so whatif's default prices encode/decode by timing it."""
  import jax
  import optax
  import jaxcomp

  mesh = jax.make_mesh((1,), ("data",))
  tx = optax.chain(jaxcomp.compressed_mean("int8_block", "data"), optax.sgd(0.1))
  state = jaxcomp.init(tx, {"w": jnp.ones((16, 8)), "b": jnp.zeros((8,))}, mesh)

  def loss(p, x):
    return jnp.mean((x @ p["w"] + p["b"][None, :]) ** 2)

  prof = pm.profile(loss, state, jnp.ones((4, 16)), repeats=1)
  assert prof.layer_sizes == (128, 8) and prof.meta["device"] == "cpu:cpu"
  path = tmp_path / "p.json"
  pm.save_profile(prof, path)
  assert cli.main(["whatif", "--profile", str(path), "-c", "bf16"]) == 0
  out = capsys.readouterr().out
  assert "device: cpu" in out and "encode/decode: measured on this machine (cpu:cpu)" in out
  assert "compute " in out and "(measured: jax.jit wall time on cpu:cpu" in out


def test_whatif_prices_the_compressed_optimizers(no_timing, capsys):
  """`jaxcomp whatif -c onebit_adam ...`: a row per optimizer; a run's
  priced bytes are its phases' (dense warm-up, 1-bit exchanges, 0/1 Adam's
  skipped rounds) as jaxcomp.get_stats would count them."""
  assert cli.main(["whatif", "--profile", "bert-base", "-b", "1",
                   "--buckets", "layer", "-c",
                   "onebit_adam", "zero_one_adam:steps=1000,freeze_step=100",
                   "onebit_lamb"]) == 0
  out = capsys.readouterr().out
  for name in ("onebit_adam", "zero_one_adam:steps=1000", "onebit_lamb"):
    assert re.search(rf"^{re.escape(name)}\S*\s+own_exchange", out, re.M), out
  profile = pm.builtin_profile("bert-base")
  net = pm.Network(16, pm.Link.from_bandwidth(1.0, 50e-6))
  opt = pm.CompressedOptimizer("zero_one_adam", steps=1000, freeze_step=100,
                               local_step_scaler=100)
  dense, onebit, skipped = pm.optimizer_phases(opt)
  assert dense + onebit + skipped == 1000 and skipped > 0
  pr = pm.predict(profile, opt, net)
  t = pm.optimizer_traffic(opt, profile.layer_sizes, 16)
  assert (t.dense_steps, t.compressed_steps, t.silent_steps) == (dense, onebit,
                                                                 skipped)
  assert pr.bytes_per_worker * 1000 == pytest.approx(t.total_bytes)
  full = pm.predict(profile, pm.DenseCompressor(), net)
  # A dense step costs what the dense baseline does; a skipped round only
  # the compute: the average lies between the compute and the dense step.
  assert profile.compute_time < pr.step_time < full.step_time
  with pytest.raises(ValueError, match="name must be one of"):
    pm.CompressedOptimizer("adam")
  with pytest.raises(ValueError, match="own exchange"):
    pm.predict(profile, opt, net, sync_every=2)
