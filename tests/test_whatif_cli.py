"""Tests of the `jaxcomp whatif` command line."""

import json
import re

import pytest

from jaxcomp import cli
from jaxcomp import perfmodel as pm

FAST = ["--codec", "none"]


def _table(out):
  """Rows of the first table: {compressor: {column: text}}."""
  lines = out.splitlines()
  i = next(k for k, line in enumerate(lines) if line.startswith("compressor"))
  header = lines[i].split()
  rows = {}
  for line in lines[i + 2:]:
    if not line.strip():
      break
    cells = line.split()
    rows[cells[0]] = dict(zip(header, cells))
  return rows


def test_whatif_table(capsys):
  assert cli.main(["whatif", "--profile", "resnet50", "--workers", "16", "--bandwidth", "1",
                   "-c", "bf16", "topk:ratio=0.01", *FAST]) == 0
  out = capsys.readouterr().out
  rows = _table(out)
  assert set(rows) == {"dense", "bf16", "topk:ratio=0.01"}
  assert rows["dense"]["speedup"] == "1.00x"
  assert rows["bf16"]["collective"] == "psum"
  assert rows["topk:ratio=0.01"]["collective"] == "allgather"
  # The table agrees with the library.
  from jaxcomp import compressors
  net = pm.Network(16, pm.Link.from_bandwidth(1, 50e-6))
  res = pm.compare(pm.builtin_profile("resnet50"), {"bf16": compressors.get("bf16")}, net,
                   buckets="mgwfbp")
  assert float(rows["bf16"]["step_ms"]) == pytest.approx(res["bf16"].step_time * 1e3, abs=0.051)
  # Halving the bytes on a 1 Gbit/s link must pay.
  assert float(rows["bf16"]["speedup"].rstrip("x")) > 1.0
  assert "ideal linear compressor" in out


def test_whatif_faster_link_means_less_speedup(capsys):
  speedups = []
  for bw in ("0.5", "5", "500"):
    cli.main(["whatif", "-b", bw, "-c", "bf16", "--buckets", "single", *FAST])
    speedups.append(float(_table(capsys.readouterr().out)["bf16"]["speedup"].rstrip("x")))
  assert speedups[0] > speedups[1] > speedups[2]


def test_whatif_simulate_and_plot(tmp_path, capsys):
  png = tmp_path / "s.png"
  assert cli.main(["whatif", "--simulate", "--plot", str(png), "-c", "qsgd:levels=16",
                   "--buckets", "single", *FAST]) == 0
  out = capsys.readouterr().out
  assert re.search(r"^4\s", out, re.M) and re.search(r"^2048\s", out, re.M)
  assert "qsgd:levels=16:" in out
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_whatif_saved_profile_and_hierarchical(tmp_path, capsys):
  prof = pm.ModelProfile("mine", [1000, 200_000], [1e-3, 2e-3], 1e-3)
  path = tmp_path / "mine.json"
  pm.save_profile(prof, path)
  assert cli.main(["whatif", "--profile", str(path), "-p", "16", "--algorithm", "hierarchical",
                   "--workers-per-node", "4", "-c", "bf16", *FAST]) == 0
  out = capsys.readouterr().out
  assert "profile mine" in out and "hierarchical" in out


def test_whatif_codec_file(tmp_path, capsys):
  codec = tmp_path / "codec.json"
  codec.write_text(json.dumps({"bf16": pm.CodecCost(encode_fixed=0.5).to_dict()}))
  cli.main(["whatif", "-c", "bf16", "--codec", str(codec)])
  rows = _table(capsys.readouterr().out)
  assert float(rows["bf16"]["codec_ms"]) >= 500.0  # 0.5 s per bucket encode, in ms
  assert float(rows["bf16"]["speedup"].rstrip("x")) < 1.0


@pytest.mark.parametrize("argv, message", [
    (["--bandwidth", "0"], "bandwidth must be > 0"),
    (["--bandwidth", "-3"], "bandwidth must be > 0"),
    (["--bandwidth", "fast"], "bandwidth must be a number"),
    (["--workers", "0"], "workers must be an integer >= 1"),
    (["--latency", "-1"], "latency must be >= 0"),
    (["--profile", "vgg19"], "unknown profile 'vgg19'"),
    (["--profile", "/nonexistent/p.json"], "does not exist"),
    (["--codec", "/nonexistent/c.json"], "does not exist"),
    (["-c", "nosuch"], "unknown compressor"),
    (["--algorithm", "hierarchical", "-p", "12", "--workers-per-node", "8"], "dividing workers"),
    (["--sharding", "hsdp"], "pass --algorithm hierarchical"),
    (["--sharding", "fsdp", "-c", "powersgd"], "cannot use 'powersgd'"),
    (["--sharding", "fsdp", "--diloco-every", "4"], "drop --sharding fsdp"),
    (["--tensor-parallel", "0"], "tensor-parallel degree must be an integer >= 1"),
])
def test_whatif_bad_input(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["whatif", *FAST[:0], *argv] + ([] if "--codec" in argv else FAST))
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_subcommand_registry():
  with pytest.raises(ValueError, match="already registered"):
    cli.register_subcommand("whatif", lambda sub: None)
  with pytest.raises(SystemExit):
    cli.main([])  # a subcommand is required


def test_whatif_collective_and_overlap_flags(capsys):
  base = ["whatif", "-p", "16", "-b", "10", "-c", "qsgd:levels=16", "topk:ratio=0.01", *FAST]
  assert cli.main(base) == 0
  default = _table(capsys.readouterr().out)
  # The default is what compressed_mean uses: Auto for QSGD, all-gather for top-k.
  assert default["qsgd:levels=16"]["collective"] == "auto"
  assert default["topk:ratio=0.01"]["collective"] == "allgather"
  assert cli.main(base + ["--collective", "allgather"]) == 0
  gathered = _table(capsys.readouterr().out)
  assert gathered["qsgd:levels=16"]["collective"] == "allgather"
  # At 16 workers QSGD's two-phase moves far fewer ring bytes than its
  # all-gather (about 2 / p of them), so it spends far less time on the link.
  assert float(default["qsgd:levels=16"]["comm_ms"]) < float(
      gathered["qsgd:levels=16"]["comm_ms"]) / 2
  assert cli.main(base + ["--overlap", "serial"]) == 0
  out = capsys.readouterr().out
  serial = _table(out)
  assert "nothing overlaps" in out
  for name in default:
    assert float(serial[name]["step_ms"]) >= float(default[name]["step_ms"])
  assert float(serial["dense"]["exposed_ms"]) == pytest.approx(
      float(serial["dense"]["comm_ms"]), abs=0.051)
  with pytest.raises(SystemExit) as e:
    cli.main(base + ["--collective", "ring"])
  assert e.value.code == 2


def test_whatif_prices_diloco(capsys):
  args = ["whatif", "-p", "16", "-b", "1", "-c", "int8_block:bits=4", *FAST]
  cli.main(args)
  step = _table(capsys.readouterr().out)["int8_block:bits=4"]
  cli.main(args + ["--diloco-every", "50"])
  out = capsys.readouterr().out
  assert "one exchange every 50 steps" in out
  rows = _table(out)
  diloco = rows["int8_block:bits=4"]
  assert float(diloco["MB/worker"]) == pytest.approx(float(step["MB/worker"]) / 50, rel=0.05)
  assert float(diloco["speedup"].rstrip("x")) > float(step["speedup"].rstrip("x"))
  assert rows["dense"]["step_ms"] == _table(cli_out(args))["dense"]["step_ms"]
  with pytest.raises(SystemExit):
    cli.main(args + ["--diloco-every", "0"])
  assert "--diloco-every must be an integer >= 1" in capsys.readouterr().err


def cli_out(args):
  import contextlib
  import io
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    cli.main(args)
  return buf.getvalue()


def test_whatif_prices_fsdp_and_hsdp(capsys):
  # The table's rows are jaxcomp.perfmodel.compare's with output="shard" /
  # "hsdp"; over a slow link between nodes HSDP keeps the gathers and the
  # reduce-scatter inside a node and beats FSDP.
  args = ["whatif", "--profile", "gpt2-small", "-p", "16", "-b", "1", "--algorithm",
          "hierarchical", "--workers-per-node", "8", "-c", "int8_block", *FAST]
  rows = {}
  for sharding, output in (("fsdp", "shard"), ("hsdp", "hsdp")):
    out = cli_out(args + ["--sharding", sharding])
    assert sharding.upper() in out
    rows[sharding] = _table(out)
    net = pm.Network(16, pm.Link.from_bandwidth(1, 50e-6), "hierarchical", 8,
                     pm.Link.from_bandwidth(1200, 5e-6))
    from jaxcomp import compressors
    want = pm.compare(pm.builtin_profile("gpt2-small"),
                      {"int8_block": compressors.get("int8_block")}, net,
                      buckets="mgwfbp", output=output)
    for name in ("dense", "int8_block"):
      assert float(rows[sharding][name]["step_ms"]) == pytest.approx(
          want[name].step_time * 1e3, abs=0.06)
  assert (float(rows["hsdp"]["int8_block"]["step_ms"])
          < float(rows["fsdp"]["int8_block"]["step_ms"]))


def test_whatif_prices_islands(capsys):
  # --sharding islands / islands-fsdp: jaxcomp.perfmodel.compare's rows
  # with output="islands" / "islands_fsdp" and --diloco-every's H.
  args = ["whatif", "--profile", "gpt2-small", "-p", "16", "-b", "1", "--algorithm",
          "hierarchical", "--workers-per-node", "8", "-c", "int8_block",
          "--diloco-every", "50", *FAST]
  net = pm.Network(16, pm.Link.from_bandwidth(1, 50e-6), "hierarchical", 8,
                   pm.Link.from_bandwidth(1200, 5e-6))
  from jaxcomp import compressors
  for sharding, output in (("islands", "islands"), ("islands-fsdp", "islands_fsdp")):
    out = cli_out(args + ["--sharding", sharding])
    assert "DiLoCo islands" in out
    rows = _table(out)
    want = pm.compare(pm.builtin_profile("gpt2-small"),
                      {"int8_block": compressors.get("int8_block")}, net,
                      buckets="mgwfbp", output=output, sync_every=50)
    for name in ("dense", "int8_block"):
      assert float(rows[name]["step_ms"]) == pytest.approx(
          want[name].step_time * 1e3, abs=0.06)
  with pytest.raises(SystemExit):
    cli.main(["whatif", "--sharding", "islands", *FAST])
  assert "pass --algorithm hierarchical" in capsys.readouterr().err


def test_whatif_prices_demo(capsys):
  # "demo" is jaxcomp.demo's exchange (perfmodel.DeMoCompressor): two
  # all-gathered arrays per tensor, 64x fewer bytes than float32 at the
  # defaults for chunk-multiple matrices.
  out = cli_out(["whatif", "--profile", "gpt2-small", "-p", "16", "-b", "1", "-c", "demo",
                 "demo:compression_topk=8", *FAST])
  rows = _table(out)
  assert rows["demo"]["collective"] == "allgather"
  assert float(rows["demo:compression_topk=8"]["MB/worker"]) < float(rows["demo"]["MB/worker"])
  want = pm.predict(pm.builtin_profile("gpt2-small"), pm.DeMoCompressor(),
                    pm.Network(16, pm.Link.from_bandwidth(1, 50e-6)), buckets="mgwfbp")
  assert float(rows["demo"]["MB/worker"]) == pytest.approx(want.bytes_per_worker / 1e6, abs=0.006)
  with pytest.raises(SystemExit):
    cli.main(["whatif", "-c", "demo:compression_topk=0", *FAST])
  assert "compression_topk must be an integer >= 1" in capsys.readouterr().err


def test_whatif_buckets_auto_is_compressed_means_default(capsys):
  # --buckets auto: compressed_mean's default plan (GPT-2 small: its
  # matrices alone, the biases and norms packed), as perfmodel prices it.
  out = cli_out(["whatif", "--profile", "gpt2-small", "-p", "16", "-b", "10",
                 "--buckets", "auto", "-c", "int8_block", *FAST])
  rows = _table(out)
  from jaxcomp import compressors
  prof = pm.builtin_profile("gpt2-small")
  want = pm.compare(prof, {"int8_block": compressors.get("int8_block")},
                    pm.Network(16, pm.Link.from_bandwidth(10, 50e-6)),
                    buckets="auto")
  assert float(rows["int8_block"]["step_ms"]) == pytest.approx(
      want["int8_block"].step_time * 1e3, abs=0.06)
  plan = pm.bucket_plan("auto", prof)
  assert sorted(i for b in plan for i in b) == list(range(len(prof.layer_sizes)))
  big = [i for i, n in enumerate(prof.layer_sizes) if 4 * n >= 1_000_000]
  assert all([i] in plan for i in big)  # each large tensor alone
  assert len(plan) < len(prof.layer_sizes) // 2  # the small ones packed


def test_whatif_prices_fsdp_by_tensor_parallelism(capsys):
  # --tensor-parallel T with --sharding hsdp (MaxText's (data, fsdp, tensor)
  # mesh: fsdp inside a node, data across): compare's rows for the profile
  # each device holds (profile.tensor_parallel(T)); every worker exchanges
  # half the bytes at T = 2.
  args = ["whatif", "--profile", "gpt2-small", "-p", "16", "-b", "1", "--algorithm",
          "hierarchical", "--workers-per-node", "8", "-c", "int8_block",
          "--sharding", "hsdp", *FAST]
  one, two = _table(cli_out(args)), _table(cli_out(args + ["--tensor-parallel", "2"]))
  out = cli_out(args + ["--tensor-parallel", "2"])
  assert "tensor parallelism over 2 devices" in out
  net = pm.Network(16, pm.Link.from_bandwidth(1, 50e-6), "hierarchical", 8,
                   pm.Link.from_bandwidth(1200, 5e-6))
  from jaxcomp import compressors
  profile = pm.builtin_profile("gpt2-small")
  want = pm.compare(profile.tensor_parallel(2),
                    {"int8_block": compressors.get("int8_block")}, net,
                    buckets="mgwfbp", output="hsdp")
  for name in ("dense", "int8_block"):
    assert float(two[name]["step_ms"]) == pytest.approx(want[name].step_time * 1e3, abs=0.06)
    assert float(two[name]["MB/worker"]) == pytest.approx(
        float(one[name]["MB/worker"]) / 2, rel=0.01)
  assert profile.tensor_parallel(1) is profile
  tp = profile.tensor_parallel(3)
  assert tp.layer_sizes == tuple(-(-n // 3) for n in profile.layer_sizes)
  assert tp.compute_time == pytest.approx(profile.compute_time / 3)
  with pytest.raises(ValueError, match="degree .* integer >= 1"):
    profile.tensor_parallel(0)
