"""Tests of jaxcomp.perfmodel: closed-form costs, the step model, MG-WFBP,
profiles, the micro-benchmarks, and the namespace benchmark's refusal checks."""

import dataclasses
import importlib.util
import itertools
import json
import math
import os
import random
import re
import sys

import jax
import pytest

from jaxcomp import cli
from jaxcomp import perfmodel as pm
from jaxcomp.bucketing import DEFAULT_BUCKET_BYTES


@dataclasses.dataclass(frozen=True)
class FakeCompressor:
  """Payload = ratio of the float32 bytes; linear or not."""
  ratio: float = 1.0
  linear: bool = True

  def payload_bytes(self, n):
    return int(math.ceil(4 * n * self.ratio))


ALPHA, BETA = 1e-4, 1e-9
LINK = pm.Link(ALPHA, BETA)


# ------------------------------------------------------------------ costs --

@pytest.mark.parametrize("p", [2, 3, 8, 64])
def test_ring_costs_closed_form(p):
  m = 3_000_000.0
  assert pm.allreduce_time(m, p, LINK) == pytest.approx(
      2 * (p - 1) * ALPHA + 2 * (p - 1) / p * m * BETA)
  assert pm.allgather_time(m, p, LINK) == pytest.approx((p - 1) * ALPHA + (p - 1) * m * BETA)
  assert pm.reduce_scatter_time(m, p, LINK) == pytest.approx(
      (p - 1) * ALPHA + (p - 1) / p * m * BETA)
  assert pm.alltoall_time(m, p, LINK) == pytest.approx((p - 1) * ALPHA + (p - 1) / p * m * BETA)
  # all-reduce = reduce-scatter + all-gather of the 1/p shards
  assert pm.allreduce_time(m, p, LINK) == pytest.approx(
      pm.reduce_scatter_time(m, p, LINK) + pm.allgather_time(m / p, p, LINK))


def test_one_worker_costs_nothing():
  for f in (pm.allreduce_time, pm.allgather_time, pm.reduce_scatter_time, pm.alltoall_time):
    assert f(1e9, 1, LINK) == 0.0


def test_link_from_bandwidth():
  link = pm.Link.from_bandwidth(10, 5e-6)
  assert link.beta == pytest.approx(8 / 10e9)
  assert link.alpha == 5e-6
  assert link.gbps == pytest.approx(10)


@pytest.mark.parametrize("gbps", [0, -1, float("nan"), float("inf")])
def test_bad_bandwidth(gbps):
  with pytest.raises(ValueError, match="bandwidth must be > 0"):
    pm.Link.from_bandwidth(gbps)


@pytest.mark.parametrize("p", [0, -3, 2.5, True])
def test_bad_workers(p):
  with pytest.raises(ValueError, match="workers must be an integer >= 1"):
    pm.Network(p, LINK)


def test_hierarchical_reduces_to_ring_and_intra():
  m = 1e7
  slow, fast = pm.Link.from_bandwidth(10, 1e-5), pm.Link.from_bandwidth(1000, 1e-6)
  ring = pm.Network(16, slow)
  one_per_node = pm.Network(16, slow, "hierarchical", workers_per_node=1, intra=fast)
  one_node = pm.Network(8, slow, "hierarchical", workers_per_node=8, intra=fast)
  for kind in pm.COLLECTIVES:
    assert pm.collective_time(kind, m, one_per_node) == pytest.approx(
        pm.collective_time(kind, m, ring))
  # One node: only the fast link is used.
  assert pm.collective_time("all-reduce", m, one_node) == pytest.approx(
      pm.allreduce_time(m, 8, fast))
  # Hierarchical all-reduce with a fast intra link beats a flat ring on the slow one.
  hier = pm.Network(16, slow, "hierarchical", workers_per_node=8, intra=fast)
  assert pm.collective_time("all-reduce", m, hier) < pm.collective_time("all-reduce", m, ring)
  with pytest.raises(ValueError, match="dividing workers"):
    pm.Network(12, slow, "hierarchical", workers_per_node=8, intra=fast)
  with pytest.raises(ValueError, match="intra"):
    pm.Network(16, slow, "hierarchical", workers_per_node=8)
  with pytest.raises(ValueError, match="unknown collective"):
    pm.collective_time("broadcast", m, ring)


# ------------------------------------------------------------- the model --

def _profile(sizes, bwd, fwd=0.01, update=0.0):
  return pm.ModelProfile("t", sizes, bwd, fwd, update)


def test_dense_single_bucket_no_overlap_is_sum():
  prof = _profile([1000, 2_000_000, 30], [1e-3, 2e-3, 3e-3], fwd=4e-3, update=1e-3)
  net = pm.Network(8, LINK)
  pr = pm.predict(prof, pm.DenseCompressor(), net, buckets="single", overlap=False)
  comm = pm.allreduce_time(4 * prof.num_params, 8, LINK)
  assert pr.step_time == pytest.approx(prof.compute_time + comm)
  assert pr.comm_time == pytest.approx(comm)
  assert pr.exposed_comm == pytest.approx(comm)
  assert pr.scaling_factor == pytest.approx(prof.compute_time / (prof.compute_time + comm))


def test_wfbp_overlap_hand_example():
  # Two layers, backward runs layer 1 then layer 0. Layer 1's all-reduce
  # starts when its gradient exists and overlaps layer 0's backward.
  prof = _profile([250_000, 250_000], [0.010, 0.010], fwd=0.0)  # 1 MB each
  net = pm.Network(2, pm.Link(0.0, 1e-8))  # all-reduce of 1 MB on 2 workers: 10 ms
  pr = pm.predict(prof, pm.DenseCompressor(), net, buckets="layer")
  # layer 1 comm: 10..20 ms; layer 0 ready at 20 ms, comm 20..30 ms.
  assert pr.step_time == pytest.approx(0.030)
  assert pr.comm_time == pytest.approx(0.020)
  assert pr.exposed_comm == pytest.approx(0.010)
  no = pm.predict(prof, pm.DenseCompressor(), net, buckets="layer", overlap=False)
  assert no.step_time == pytest.approx(0.040)


def test_one_worker_is_compute_only():
  prof = _profile([10, 20], [1e-3, 1e-3])
  pr = pm.predict(prof, FakeCompressor(0.1), pm.Network(1, LINK),
                  codec=pm.CodecCost(1.0, 1.0, 1.0, 1.0))
  assert pr.step_time == pytest.approx(prof.compute_time)
  assert pr.scaling_factor == pytest.approx(1.0)


def test_nonlinear_uses_allgather_and_decodes_p_payloads():
  n = 1_000_000
  prof = _profile([n], [0.0], fwd=0.0)
  p = 8
  net = pm.Network(p, LINK)
  codec = pm.CodecCost(encode_fixed=1e-3, decode_fixed=2e-3)
  c = FakeCompressor(0.01, linear=False)
  pr = pm.predict(prof, c, net, codec=codec, buckets="single")
  assert pr.comm_time == pytest.approx(pm.allgather_time(c.payload_bytes(n), p, LINK))
  assert pr.codec_time == pytest.approx(1e-3 + p * 2e-3)
  assert pr.step_time == pytest.approx(1e-3 + pr.comm_time + p * 2e-3)
  lin = pm.predict(prof, FakeCompressor(0.01, linear=True), net, codec=codec, buckets="single")
  assert lin.comm_time == pytest.approx(pm.allreduce_time(c.payload_bytes(n), p, LINK))
  assert lin.codec_time == pytest.approx(3e-3)
  # Two arrays per payload: one more start-up cost per bucket.
  two = pm.predict(prof, c, net, codec=codec, buckets="single", messages_per_bucket=2)
  assert two.comm_time == pytest.approx(pr.comm_time + (p - 1) * ALPHA)
  # Error feedback decodes the worker's own payload once more.
  ef = pm.predict(prof, c, net, codec=codec, buckets="single", error_feedback=True)
  assert ef.codec_time == pytest.approx(1e-3 + (p + 1) * 2e-3)


def test_two_phase_and_auto_price_both_phases():
  n, p = 1_000_000, 8
  prof = _profile([n], [0.0], fwd=0.0)
  net = pm.Network(p, LINK)
  codec = pm.CodecCost(encode_fixed=1e-3, decode_fixed=2e-3)
  c = FakeCompressor(0.01, linear=False)
  chunk = c.payload_bytes(n // p)
  tp = pm.predict(prof, c, net, codec=codec, buckets="single", collective="two_phase")
  assert tp.comm_time == pytest.approx(pm.alltoall_time(p * chunk, p, LINK)
                                       + pm.allgather_time(chunk, p, LINK))
  assert tp.bytes_per_worker == (p + 1) * chunk
  # p chunk encodes; p decodes, a re-encode, p decodes of the gathered chunks.
  assert tp.codec_time == pytest.approx(p * 1e-3 + 2 * p * 2e-3 + 1e-3)
  # Auto takes two-phase here (2 * payload(n / p) < payload(n) at p = 8) ...
  auto = pm.predict(prof, c, net, codec=codec, buckets="single", collective="auto")
  assert auto.comm_time == tp.comm_time
  # ... and the all-gather where the chunks' payloads would not be smaller,
  # like jaxcomp.collectives.Auto.
  class Fixed(FakeCompressor):  # a fixed-size payload
    def payload_bytes(self, m):
      return 64

  flat = Fixed(0.01, linear=False)
  ag = pm.predict(prof, flat, net, buckets="single", collective="auto")
  assert ag.comm_time == pytest.approx(pm.allgather_time(64, p, LINK))
  with pytest.raises(ValueError, match="linear"):
    pm.predict(prof, FakeCompressor(0.01, linear=True), net, collective="two_phase")
  with pytest.raises(ValueError, match="collective"):
    pm.predict(prof, c, net, collective="ring")


def test_monotone_in_bandwidth_and_workers():
  prof = pm.builtin_profile("resnet50")
  c = FakeCompressor(0.25)
  prev = None
  for g in (0.1, 1, 10, 100, 1000):
    net = pm.Network(16, pm.Link.from_bandwidth(g, 1e-5))
    t = pm.predict(prof, c, net, buckets="layer").step_time
    assert prev is None or t <= prev + 1e-12
    prev = t
  prev = None
  for p in (1, 2, 4, 16, 256):
    s = pm.predict(prof, pm.DenseCompressor(), pm.Network(p, LINK), buckets="layer").scaling_factor
    assert s <= 1.0 + 1e-12 and (prev is None or s <= prev + 1e-12)
    prev = s


def test_compare_speedup_and_codec_cost_hurts():
  prof = pm.builtin_profile("bert-base")
  net = pm.Network(16, pm.Link.from_bandwidth(1, 1e-5))
  comps = {"half": FakeCompressor(0.5), "tenth": FakeCompressor(0.1)}
  res = pm.compare(prof, comps, net, buckets="layer")
  assert res["dense"].speedup == 1.0
  for name in comps:
    assert res[name].speedup == pytest.approx(res["dense"].step_time / res[name].step_time)
  assert res["tenth"].speedup > res["half"].speedup > 1.0
  slow = pm.compare(prof, comps, net, buckets="layer",
                    codecs={"tenth": pm.CodecCost(encode_per_element=1e-8)})
  assert slow["tenth"].speedup < res["tenth"].speedup


def test_bucket_plans():
  prof = _profile([1, 2, 3, 4], [0, 0, 0, 0])
  assert pm.bucket_plan("layer", prof) == [[3], [2], [1], [0]]
  assert pm.bucket_plan("single", prof) == [[0, 1, 2, 3]]
  assert pm.bucket_plan(20, prof) == [[2, 3], [0, 1]]  # 16+12 bytes, then 8+4
  assert pm.bucket_plan([[2, 3], [0, 1]], prof) == [[2, 3], [0, 1]]
  for bad in ([[0, 1], [2, 3]], [[3], [1], [0]], [[3, 1], [2, 0]], "foo", -1):
    with pytest.raises(ValueError):
      pm.bucket_plan(bad, prof)


def test_profile_validation_and_roundtrip(tmp_path):
  with pytest.raises(ValueError, match="differ in length"):
    _profile([1, 2], [0.1])
  prof = pm.builtin_profile("gpt2-small")
  path = tmp_path / "p.json"
  pm.save_profile(prof, path)
  back = pm.load_profile(str(path))
  assert back.layer_sizes == prof.layer_sizes
  assert back.backward_times == pytest.approx(prof.backward_times)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    pm.load_profile(str(tmp_path / "missing.json"))
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match="not JSON"):
    pm.load_profile(str(bad))
  bad.write_text(json.dumps({"name": "x"}))
  with pytest.raises(ValueError, match="missing fields"):
    pm.load_profile(str(bad))
  with pytest.raises(ValueError, match="unknown profile 'vgg'"):
    pm.load_profile("vgg")


def test_builtin_profiles_match_architectures():
  # Parameter counts of the reference implementations.
  expected = {"resnet50": 25_557_032, "resnet18-cifar": 11_173_962, "bert-base": 109_482_240,
              "gpt2-small": 124_439_808}
  for name, n in expected.items():
    prof = pm.builtin_profile(name)
    assert prof.num_params == n
    assert all(t >= 0 for t in prof.backward_times)
    # Backward FLOPs are twice the forward's.
    assert prof.backward_time == pytest.approx(2 * prof.forward_time)
    # Twice the device speed halves every time.
    fast = pm.builtin_profile(name, tflops=2 * pm.profiles.DEFAULT_TFLOPS)
    assert fast.compute_time == pytest.approx(prof.compute_time / 2)


# -------------------------------------------------------------- MG-WFBP --

def _partitions(L):
  for cuts in itertools.product([False, True], repeat=L - 1):
    buckets, group = [], [L - 1]
    for l, cut in zip(range(L - 1, 0, -1), cuts):
      if cut:
        buckets.append(sorted(group))
        group = []
      group.append(l - 1)
    buckets.append(sorted(group))
    yield buckets


def test_mgwfbp_extremes():
  # Start-up cost dwarfs everything: merge all.
  assert pm.mgwfbp_plan([4] * 5, [1e-3] * 5, alpha=1.0, beta=0.0) == [[0, 1, 2, 3, 4]]
  # Communication finishes before the next gradient exists: never merge.
  assert pm.mgwfbp_plan([4] * 4, [1.0] * 4, alpha=1e-6, beta=1e-9) == [[3], [2], [1], [0]]


def test_mgwfbp_hand_example():
  # Backward order: layer 2 (ready t=1), layer 1 (t=2), layer 0 (t=2.1).
  # tc = 0.5 + m. Layer 2's comm runs 1..1.5+m2, finishes before layer 1 is
  # ready -> no merge. Layer 1's comm would start at 2 and layer 0 is ready at
  # 2.1 < 2 + 0.5 + m1; it waits 0.1 < alpha -> merge layers 1 and 0.
  plan = pm.mgwfbp_plan([0.1, 0.1, 0.1], [0.1, 1.0, 1.0], alpha=0.5, beta=1.0)
  assert plan == [[2], [0, 1]]
  t = pm.wfbp_finish_time(plan, [0.1] * 3, [0.1, 1.0, 1.0], 0.5, 1.0)
  assert t == pytest.approx(2.1 + 0.5 + 0.2)


def test_mgwfbp_beats_per_layer_and_single_on_many_small_layers():
  # Paper-style: a deep network of many small layers (biases, norms) between
  # a few big ones, on 10 GbE constants from the MG-WFBP repository.
  sizes, bwd = [], []
  for i in range(60):
    big = i % 10 == 0
    sizes.append(2_000_000 if big else 2_000)
    bwd.append(2e-3 if big else 5e-5)
  prof = pm.ModelProfile("deep", sizes, bwd, forward_time=0.02)
  alpha, beta_link = 0.91e-3, 0.74e-9
  net = pm.Network(16, pm.Link(alpha / 30, beta_link / (30 / 16)))
  plan = pm.mgwfbp_plan([4 * n for n in sizes], bwd, alpha, beta_link)
  assert 1 < len(plan) < len(sizes)
  times = {b: pm.predict(prof, pm.DenseCompressor(), net, buckets=b).step_time
           for b in ("mgwfbp", "layer", "single")}
  times["plan"] = pm.predict(prof, pm.DenseCompressor(), net, buckets=plan).step_time
  assert times["mgwfbp"] < times["layer"]
  assert times["mgwfbp"] < times["single"]
  assert times["plan"] < times["layer"] and times["plan"] < times["single"]


def test_mgwfbp_never_worse_than_layer_or_single_random():
  rng = random.Random(0)
  for _ in range(300):
    L = rng.randint(1, 12)
    lb = [rng.choice([1e3, 1e4, 1e5, 1e6, 4e6]) for _ in range(L)]
    tb = [rng.uniform(0, 3e-3) for _ in range(L)]
    a, b = rng.choice([1e-5, 1e-4, 1e-3]), rng.choice([1e-10, 7.4e-10, 4e-9])
    plan = pm.mgwfbp_plan(lb, tb, a, b)
    assert [i for g in plan for i in reversed(g)] == list(reversed(range(L)))
    assert all(g == list(range(g[0], g[-1] + 1)) for g in plan)
    t = pm.wfbp_finish_time(plan, lb, tb, a, b)
    assert t <= pm.wfbp_finish_time([[i] for i in reversed(range(L))], lb, tb, a, b) * (1 + 1e-12)
    assert t <= pm.wfbp_finish_time([list(range(L))], lb, tb, a, b) * (1 + 1e-12)
    if L <= 6:  # and never far from the best partition
      best = min(pm.wfbp_finish_time(q, lb, tb, a, b) for q in _partitions(L))
      assert t <= 1.5 * best


def test_mgwfbp_errors():
  with pytest.raises(ValueError, match="differ in length"):
    pm.mgwfbp_plan([1, 2], [1], 0, 0)
  with pytest.raises(ValueError, match="alpha and beta"):
    pm.mgwfbp_plan([1], [1], -1, 0)


# ------------------------------------------------------------ simulation --

def test_required_ratio_grows_as_bandwidth_falls():
  prof = pm.builtin_profile("resnet50")
  ratios = [pm.required_ratio(prof, pm.Network(16, pm.Link.from_bandwidth(g, 1e-6)),
                              buckets="single") for g in (1000, 10, 1)]
  assert ratios[0] == 1.0
  assert 1.0 < ratios[1] < ratios[2] < math.inf
  # The returned ratio reaches the target and a clearly smaller one does not.
  net = pm.Network(16, pm.Link.from_bandwidth(1, 1e-6))
  s = lambda r: pm.predict(prof, pm.IdealCompressor(r), net, buckets="single").scaling_factor
  assert s(ratios[2]) >= 0.9 > s(ratios[2] / 1.1)


def test_sweeps_and_stops_paying():
  prof = pm.builtin_profile("resnet50")
  net = pm.Network(4, pm.Link.from_bandwidth(10, 5e-5))
  comps = {"ag": FakeCompressor(0.01, linear=False)}
  sweep = pm.sweep_workers(prof, comps, net, (4, 16, 256, 2048), buckets="single")
  assert set(sweep) == {4, 16, 256, 2048}
  # An all-gather's cost grows with p while the dense all-reduce's saturates:
  k = pm.stops_paying(sweep, "ag")
  assert k is not None and sweep[k]["ag"].speedup < 1 <= sweep[4]["ag"].speedup
  bw = pm.sweep_bandwidth(prof, comps, net, [0.1, 1, 10, 100, 1000], buckets="single")
  speedups = [bw[g]["ag"].speedup for g in sorted(bw)]
  assert speedups == sorted(speedups, reverse=True)


# ------------------------------------------------- measured on the device --

def test_measure_codec_fake_jax_compressor():
  import jax.numpy as jnp

  class Cast:
    linear = True

    def payload_bytes(self, n):
      return 2 * n

    def encode(self, x, key):
      del key
      return x.astype(jnp.bfloat16)

    def decode(self, payload, n, key):
      del key
      return payload.astype(jnp.float32).reshape(n)

  cost = pm.measure_codec(Cast(), sizes=(1 << 8, 1 << 12), repeats=1)
  assert cost.device.startswith("cpu")
  for v in (cost.encode_fixed, cost.encode_per_element, cost.decode_fixed, cost.decode_per_element):
    assert v >= 0 and math.isfinite(v)
  assert cost.encode(1 << 12) > 0
  with pytest.raises(ValueError, match="sizes"):
    pm.measure_codec(Cast(), sizes=())


@pytest.mark.parametrize("split", ["cost", "measure"])
def test_profile_orders_layers_and_times_backward(split):
  import jax
  import jax.numpy as jnp

  k1, k2 = jax.random.split(jax.random.key(0))
  # Names sort opposite to execution order: "z_in" runs first.
  params = {"z_in": jax.random.normal(k1, (64, 128)), "a_out": jax.random.normal(k2, (128, 8))}
  x = jnp.ones((32, 64))

  def loss(p, x):
    return jnp.mean(jnp.tanh(x @ p["z_in"]) @ p["a_out"]) ** 2

  prof = pm.profile(loss, params, x, max_groups=2, repeats=1, split=split)
  assert prof.layer_sizes == (64 * 128, 128 * 8)
  assert prof.meta["paths"] == ["['z_in']", "['a_out']"]
  assert prof.forward_time > 0
  assert prof.backward_time == pytest.approx(prof.meta["backward_total"])
  # What it records: the device, JAX, the batch and how each number was made.
  assert prof.meta["device"] == f"{jax.devices()[0].platform}:{jax.devices()[0].device_kind}"
  assert prof.meta["jax"] == jax.__version__ and prof.meta["batch"] == ["float32[32, 64]"]
  assert prof.meta["forward_time"].startswith("measured: jax.jit wall time")
  assert ("cost analysis" if split == "cost" else "timed differences") in (
      prof.meta["backward_times"])
  assert prof.meta["update_time"].startswith("assumed 0")


def test_profile_split_by_measure_never_drops_the_backward_time_in_noise(monkeypatch):
  import jax.numpy as jnp

  from jaxcomp.perfmodel import profiling

  # The first timing (the whole gradient) is well above the forward pass; the
  # per-group timings taken after it come back at 0 (a noisy, busy machine),
  # so every timed difference is <= 0: the measured total must still be split.
  calls = []

  def noisy(self, g, repeats):
    calls.append(g)
    return 1.0 if len(calls) == 1 else 0.0

  monkeypatch.setattr(profiling._Suffixes, "time", noisy)
  params = {"a": jnp.ones((4, 8)), "b": jnp.ones((8, 2))}
  prof = pm.profile(lambda p, x: jnp.sum(jnp.tanh(x @ p["a"]) @ p["b"]), params,
                    jnp.ones((3, 4)), max_groups=2, repeats=1, split="measure")
  assert prof.backward_time == pytest.approx(prof.meta["backward_total"])
  assert prof.backward_time > 0.9
  # Split by element count: 32 and 16 elements.
  assert prof.backward_times[0] == pytest.approx(2 * prof.backward_times[1])
  assert "split by element count" in prof.meta["backward_times"]


def test_profile_of_a_flax_nnx_module():
  import jax.numpy as jnp
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.b = nnx.Linear(16, 32, rngs=rngs)
      self.a = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
      return self.a(nnx.relu(self.b(x)))

  prof = pm.profile(Net(nnx.Rngs(0)), jnp.ones((8, 16)), jnp.zeros((8,), jnp.int32),
                    max_groups=1, repeats=1)
  assert prof.layer_sizes == (16 * 32, 32, 32 * 4, 4)
  assert prof.name == "Net"


# ------------------------------------------- the namespace benchmark's guards --

def test_netns_refuses_without_root_or_tc(monkeypatch):
  netns = _netns_module()
  monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
  with pytest.raises(netns.NetnsUnavailable, match="root"):
    netns.check_prerequisites()
  monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
  real_which = netns.shutil.which
  monkeypatch.setattr(netns.shutil, "which", lambda c: None if c == "tc" else real_which(c))
  with pytest.raises(netns.NetnsUnavailable, match="tc"):
    netns.check_prerequisites()


def _netns_module():
  """benchmarks/netns.py (benchmark tooling, imported as the benchmarks
  import it: from their own folder)."""
  folder = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
  if folder not in sys.path:
    sys.path.insert(0, folder)
  import netns  # pylint: disable=g-import-not-at-top
  return netns


def _validation_module():
  """benchmarks/validate_perfmodel.py, imported (it is a script, not a package)."""
  path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "validate_perfmodel.py")
  spec = importlib.util.spec_from_file_location("validate_perfmodel", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_validation_benchmark_refuses_without_root(monkeypatch, capsys):
  netns = _netns_module()
  mod = _validation_module()
  monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
  created = []
  monkeypatch.setattr(netns.RateLimitedCluster, "_create", lambda self: created.append(1))
  assert mod.main(["--workers", "2", "--rates", "100mbit"]) == 2
  err = capsys.readouterr().err
  assert "refusing to run" in err and "root" in err
  assert not created


def test_validation_fit_recovers_alpha_beta():
  mod = _validation_module()
  p, link, c0 = 4, pm.Link(2e-4, 8e-9), 1.5e-3
  meas = []
  for m, k in ((4096, 1), (4096, 8), (65536, 1), (65536, 8), (524288, 1), (2097152, 1)):
    for kind, fn in (("allreduce", pm.allreduce_time), ("allgather", pm.allgather_time)):
      meas.append({"kind": kind, "bytes": m, "count": k, "seconds": c0 + k * fn(m, p, link)})
  alpha, beta, sync = mod.fit_alpha_beta(meas, p)
  assert alpha == pytest.approx(link.alpha, rel=1e-6)
  assert beta == pytest.approx(link.beta, rel=1e-6)
  assert sync == pytest.approx(c0, rel=1e-6)
  # Single-message programs only: no c0 (alpha absorbs it).
  single = [dict(c, seconds=c["seconds"] - c0) for c in meas if c["count"] == 1]
  alpha, beta, sync = mod.fit_alpha_beta(single, p)
  assert (alpha, sync) == (pytest.approx(link.alpha, rel=1e-6), 0.0)
  assert beta == pytest.approx(link.beta, rel=1e-6)
  with pytest.raises(ValueError, match="small"):
    mod.fit_alpha_beta([c for c in meas if c["bytes"] >= 524288], p)


def test_validation_startup_fit_is_the_marginal_operand_at_the_rate():
  # --fit startup (the default): bandwidth the tc rate; per kind the
  # start-up cost from t(K) - t(1) at the smallest size, so the per-step
  # sync c0 and the compute (both in every program) cancel exactly.
  mod = _validation_module()
  p, c0 = 2, 7e-3
  links = {"allreduce": pm.Link(3.5e-3, 8e-9), "allgather": pm.Link(1.5e-3, 8e-9)}
  fns = {"allreduce": pm.allreduce_time, "allgather": pm.allgather_time}
  meas = [{"kind": kind, "bytes": m, "count": k,
           "seconds": c0 + k * fns[kind](m, p, links[kind])}
          for m, k in mod.COLL_CASES for kind in links for m in [4 * m]]
  fits = mod.fit_startup(meas, p, "1gbit")
  for kind, link in links.items():
    assert fits[kind] == (pytest.approx(link.alpha, rel=1e-9), 8e-9)
  # Not the fitted bandwidth: the rate, whatever the large messages took.
  slow = [dict(c, seconds=2 * c["seconds"]) if c["bytes"] >= 1 << 19 else c for c in meas]
  assert mod.fit_startup(slow, p, "1gbit")["allreduce"][1] == 8e-9
  # No rate to name: the bandwidth from the two largest messages.
  fits = mod.fit_startup(meas, p, "unlimited")
  for kind, link in links.items():
    assert fits[kind] == (pytest.approx(link.alpha, rel=1e-9), pytest.approx(8e-9, rel=1e-9))
  with pytest.raises(ValueError, match="two sizes with 1 operand"):
    mod.fit_startup([c for c in meas if c["bytes"] == 4096], p, "unlimited")
  with pytest.raises(ValueError, match="1 and more operands"):
    mod.fit_startup([c for c in meas if c["count"] == 1], p, "1gbit")
  flat = [dict(c, seconds=c0) for c in meas]  # 8 operands no slower than 1
  with pytest.raises(ValueError, match="no longer than 1"):
    mod.fit_startup(flat, p, "1gbit")


def test_validation_report_refuses_steps_with_a_nonfinite_loss():
  # A compressed optimizer skips its exchange on a NaN gradient
  # (nonfinite="skip"): such steps are not the steps to compare with.
  mod = _validation_module()
  root = os.path.join(os.path.dirname(__file__), "..")
  runs = mod.load_runs([os.path.join(root, "docs", "perfmodel_validation_p2.json")])
  specs = ["identity", "bf16"]
  for res in runs.values():
    res["last_loss"] = {"identity:mesh": 2.3, "identity:local": 2.3,
                        "bf16:mesh": float("nan"), "bf16:local": 2.3}
  lines = []
  table, _ = mod.report(runs, specs, print_=lines.append, compute="local", fit="per-kind")
  assert {r["compressor"] for r in table} == {"identity"}
  assert len(table) == len(runs)
  assert any("bf16: no comparison, the last loss was not finite" in ln for ln in lines)


def test_serial_overlap_is_the_sum_of_everything():
  # Two buckets, codec costs on: "serial" adds every collective and every
  # decode to the compute, where "after_backward" lets bucket 1's decode
  # run during bucket 0's collective.
  prof = _profile([250_000, 250_000], [0.010, 0.010], fwd=0.002, update=0.001)
  net = pm.Network(2, pm.Link(0.0, 1e-8))
  codec = pm.CodecCost(encode_fixed=1e-3, decode_fixed=4e-3)
  c = FakeCompressor(0.5, linear=True)
  comm = pm.allreduce_time(c.payload_bytes(250_000), 2, net.link)
  serial = pm.predict(prof, c, net, codec=codec, buckets="layer", overlap="serial")
  assert serial.step_time == pytest.approx(prof.compute_time + 2 * (1e-3 + comm + 4e-3))
  assert serial.codec_time == pytest.approx(2 * (1e-3 + 4e-3))
  after = pm.predict(prof, c, net, codec=codec, buckets="layer", overlap="after_backward")
  assert after.step_time == pm.predict(prof, c, net, codec=codec, buckets="layer",
                                       overlap=False).step_time
  # The first decode (4 ms) hides under the second collective (comm > 4 ms).
  assert comm > 4e-3
  assert after.step_time == pytest.approx(serial.step_time - 4e-3)
  with pytest.raises(ValueError, match="overlap"):
    pm.predict(prof, c, net, overlap="sometimes")


def test_default_collective_follows_the_library():
  from jaxcomp import compressors
  kinds = {n: pm.default_collective(compressors.get(n))
           for n in ("bf16", "random_block", "topk", "sign", "qsgd", "int8_block",
                     "powersgd", "terngrad")}
  assert kinds == {"bf16": "psum", "random_block": "psum", "topk": "allgather",
                   "sign": "allgather", "qsgd": "auto", "int8_block": "auto",
                   "powersgd": "own_exchange", "terngrad": "own_exchange"}
  # PowerSGD is priced as the two all-reduces it runs (the P's, then the
  # Q's), not an all-gather: the library's own transfers, in the flat view.
  n, p = 1_000_000, 8
  prof = _profile([n], [0.0], fwd=0.0)
  net = pm.Network(p, LINK)
  psgd = compressors.get("powersgd", rank=4)
  ts = pm.bucket_transfers(psgd, n, p)
  assert [t.kind for t in ts] == ["all-reduce", "all-reduce"]
  assert sum(t.operand_bytes for t in ts) == psgd.payload_bytes(n)
  pr = pm.predict(prof, psgd, net, buckets="single")
  assert pr.comm_time == pytest.approx(
      sum(pm.allreduce_time(t.operand_bytes, p, LINK) for t in ts))
  assert pr.comm_time == pytest.approx(
      pm.allreduce_time(psgd.payload_bytes(n), p, LINK) + 2 * (p - 1) * ALPHA)
  assert pr.bytes_per_worker == psgd.payload_bytes(n)
  with pytest.raises(ValueError, match="own"):
    pm.predict(prof, psgd, net, collective="two_phase")
  # QSGD goes through Auto, which takes two-phase at 8 workers.
  q = compressors.get("qsgd", levels=16)
  assert pm.predict(prof, q, net, buckets="single").comm_time == pytest.approx(
      pm.predict(prof, q, net, buckets="single", collective="two_phase").comm_time)


def test_compare_collective_applies_to_compressors_that_are_not_linear():
  n, p = 1_000_000, 8
  prof = _profile([n], [0.0], fwd=0.0)
  net = pm.Network(p, LINK)
  comps = {"lin": FakeCompressor(0.5, linear=True), "sparse": FakeCompressor(0.01, linear=False)}
  res = pm.compare(prof, comps, net, buckets="single", collective="two_phase")
  assert res["lin"].comm_time == pytest.approx(pm.allreduce_time(2 * n, p, LINK))
  assert res["sparse"].comm_time == pytest.approx(
      pm.predict(prof, comps["sparse"], net, buckets="single",
                 collective="two_phase").comm_time)
  per_name = pm.compare(prof, comps, net, buckets="single", collective={"sparse": "allgather"})
  assert per_name["sparse"].comm_time == pytest.approx(
      pm.allgather_time(comps["sparse"].payload_bytes(n), p, LINK))
  with pytest.raises(ValueError, match="not in compressors"):
    pm.compare(prof, comps, net, collective={"other": "auto"})
  with pytest.raises(ValueError, match="collective"):
    pm.compare(prof, comps, net, collective="ring")


def test_results_page_validation_table_is_the_saved_measurements_report():
  # docs/real_links.md's measured / predicted table must be what
  # `validate_perfmodel.py --report-from docs/perfmodel_validation_p*.json
  # --compute local` prints from the raw measurements kept in docs/.
  root = os.path.join(os.path.dirname(__file__), "..")
  mod = _validation_module()
  runs = mod.load_runs([os.path.join(root, "docs", f"perfmodel_validation_p{p}.json")
                        for p in (2, 4)])
  table, _ = mod.report(runs, list(mod.COMPRESSORS), print_=lambda s: None, compute="local",
                        fit="per-kind")
  with open(os.path.join(root, "docs", "real_links.md")) as f:
    page = f.read()
  cells = {}
  for n, rate, rest in re.findall(r"^\| (\d), (\w+) \|(.*)\|$", page, re.M):
    for spec, cell in zip(mod.COMPRESSORS, rest.split("|")):
      cells[(int(n), rate, spec)] = cell.strip()
  assert len(cells) == len(table) == 40
  for r in table:
    want = (f"{r['measured_ms']:.0f} / {r['predicted_ms']:.0f} "
            f"({100 * r['rel_error']:+.0f}%)")
    assert cells[(r["workers"], r["rate"], r["compressor"])] == want, r


def test_model_prices_the_library_transfers():
  from jaxcomp import collectives, compressors, wire
  p, n = 4, 100_000
  prof = _profile([n], [0.0], fwd=0.0)
  net = pm.Network(p, LINK)
  # Top-k: one all-gather per payload array (values, indices), as the
  # collective lists them; the model's comm is their alpha-beta sum.
  topk = compressors.get("topk", ratio=0.01)
  ts = pm.bucket_transfers(topk, n, p)
  lib = collectives.get(None, topk).buffer_transfers(topk, n, {"data": p})
  assert ts == lib and [t.kind for t in ts] == ["all-gather"] * len(topk.payload_arrays(n))
  pr = pm.predict(prof, topk, net, buckets="single")
  assert pr.comm_time == pytest.approx(
      sum(pm.ring_time(t.kind, t.operand_bytes, p, LINK) for t in ts))
  assert pr.comm_time == pytest.approx(sum(pm.transfer_time(t, net) for t in ts))
  assert pr.bytes_per_worker == wire.operand_bytes(ts)
  # QSGD through Auto: the model takes the collective Auto.pick takes, at
  # each size (all-gather for a tiny bucket, two-phase for a large one).
  qsgd = compressors.get("qsgd")
  for size in (10, n):
    picked = collectives.Auto().pick(qsgd, size, p)
    assert pm.bucket_transfers(qsgd, size, p) == picked.buffer_transfers(
        qsgd, size, {"data": p})
  assert {t.kind for t in pm.bucket_transfers(qsgd, 10, p)} == {"all-gather"}
  assert {t.kind for t in pm.bucket_transfers(qsgd, n, p)} == {"all-to-all", "all-gather"}
  # The library's arrays are its own: messages_per_bucket is refused.
  with pytest.raises(ValueError, match="messages_per_bucket.*declares its payload arrays"):
    pm.predict(prof, topk, net, messages_per_bucket=2)
  with pytest.raises(ValueError, match="workers=8"):
    pm.transfer_time(ts[0], pm.Network(8, LINK))


def test_ring_time_is_the_wire_table():
  from jaxcomp import wire
  for kind in wire.KINDS:
    for g in (1, 2, 5):
      assert pm.ring_time(kind, 1000.0, g, LINK) == pytest.approx(
          wire.ring_messages(kind, g) * ALPHA + wire.ring_bytes(kind, 1000.0, g) * BETA)
  assert pm.allreduce_time(1000.0, 4, LINK) == pytest.approx(6 * ALPHA + 1500 * BETA)
  assert pm.allgather_time(1000.0, 4, LINK) == pytest.approx(3 * ALPHA + 3000 * BETA)


def test_fixed_size_plan_is_the_library_fill():
  from jaxcomp import bucketing
  prof = _profile([100, 50, 300, 20, 10], [1e-3] * 5, fwd=0.0)
  plan = pm.bucket_plan(1000, prof)
  fill = bucketing.fill(range(4, -1, -1), [4 * n for n in prof.layer_sizes], 1000)
  assert plan == [sorted(b) for b in fill] == [[2, 3, 4], [0, 1]]


def test_sharded_steps_price_the_reduce_scatter_and_the_parameter_gathers():
  from jaxcomp import collectives, compressors
  p, sizes = 8, [1000, 40_000]
  prof = _profile(sizes, [0.0, 0.0], fwd=0.0)
  net = pm.Network(p, LINK)
  gathers = sum(pm.allgather_time(4 * -(-n // p), p, LINK) for n in sizes)
  dense = pm.predict(prof, pm.DenseCompressor(), net, buckets="layer", output="shard")
  rs = sum(pm.ring_time("reduce-scatter", 4 * p * -(-n // p), p, LINK) for n in sizes)
  assert dense.comm_time == pytest.approx(gathers + rs)
  assert dense.step_time == pytest.approx(gathers + rs)  # nothing else to do
  # int8 blocks: one all-to-all of the chunk payloads per array, as the
  # library's collective lists them.
  c = compressors.get("int8_block")
  pr = pm.predict(prof, c, net, buckets="layer", output="shard")
  ts = [t for n in sizes for t in collectives.Auto().reduce_scatter_transfers(
      c, p * -(-n // p), {"data": p})]
  assert {t.kind for t in ts} == {"all-to-all"}
  assert pr.comm_time == pytest.approx(gathers + sum(pm.transfer_time(t, net) for t in ts))
  assert pr.bytes_per_worker == sum(t.operand_bytes for t in ts)
  out = pm.compare(prof, {"int8": c}, net, output="shard")
  assert out["int8"].speedup == pytest.approx(dense.step_time / pr.step_time)
  with pytest.raises(ValueError, match="own exchange"):
    pm.predict(prof, compressors.get("powersgd"), net, output="shard")


def test_hsdp_prices_exact_shards_inside_and_compressed_shards_across():
  # 2 nodes of 4: the parameters gathered over the node's fast link, each
  # bucket reduce-scattered there, then each device's shard all-reduced
  # across nodes, the 4 devices of a node sharing its slow link.
  from jaxcomp import collectives, compressors
  g, sizes = 4, [1000, 40_000]
  prof = _profile(sizes, [0.0, 0.0], fwd=0.0)
  fast, slow = pm.Link(1e-6, 8 / 100e9), pm.Link(ALPHA, BETA)
  net = pm.Network(8, slow, algorithm="hierarchical", workers_per_node=g, intra=fast)
  shared = pm.Link(ALPHA, BETA * g)
  c = [-(-n // g) for n in sizes]
  gathers = sum(pm.allgather_time(4 * ci, g, fast) for ci in c)
  rs = sum(pm.ring_time("reduce-scatter", 4 * g * ci, g, fast) for ci in c)
  across = sum(pm.allreduce_time(4 * ci, 2, shared) for ci in c)
  dense = pm.predict(prof, pm.DenseCompressor(), net, output="hsdp")
  assert dense.comm_time == pytest.approx(gathers + rs + across)
  assert dense.step_time == pytest.approx(gathers + rs + across)
  assert dense.bytes_per_worker == sum(4 * g * ci + 4 * ci for ci in c)
  # int8 blocks across nodes: the shard's exchange as the library lists it.
  q = compressors.get("int8_block")
  pr = pm.predict(prof, q, net, output="hsdp")
  ts = [t for ci in c for t in collectives.Auto().pick(q, ci, 2).buffer_transfers(
      q, ci, {"hosts": 2})]
  assert pr.comm_time == pytest.approx(
      gathers + rs + sum(pm.transfer_time(t, pm.Network(2, shared)) for t in ts))
  # On a slow link between nodes HSDP beats FSDP over all 8 devices, whose
  # gathers and reduce-scatter cross it.
  fsdp = pm.predict(prof, q, net, output="shard")
  assert pr.step_time < fsdp.step_time
  with pytest.raises(ValueError, match="hierarchical"):
    pm.predict(prof, q, pm.Network(8, slow), output="hsdp")


def test_diloco_amortizes_one_serial_exchange_over_its_interval():
  from jaxcomp import compressors
  prof = _profile([100_000, 2_000_000], [2e-3, 3e-3], fwd=4e-3, update=1e-3)
  net = pm.Network(8, pm.Link.from_bandwidth(1.0, 50e-6))
  c = compressors.get("int8_block", bits=4)
  codec = pm.CodecCost(1e-4, 1e-9, 1e-4, 1e-9)
  serial = pm.predict(prof, c, net, codec=codec, overlap="serial")
  for h in (1, 10, 100):
    pr = pm.predict(prof, c, net, codec=codec, sync_every=h)
    if h == 1:
      continue
    assert pr.step_time == pytest.approx(prof.compute_time
                                         + (serial.step_time - prof.compute_time) / h)
    assert pr.bytes_per_worker == pytest.approx(serial.bytes_per_worker / h)
    assert pr.comm_time == pytest.approx(serial.comm_time / h)
  out = pm.compare(prof, {"int4": c}, net, sync_every=50)
  dense = pm.predict(prof, pm.DenseCompressor(), net)
  assert out["dense"].step_time == dense.step_time  # data parallelism, every step
  assert out["int4"].speedup > 1.0
  with pytest.raises(ValueError, match="sync_every"):
    pm.predict(prof, c, net, sync_every=0)


def test_demo_is_priced_by_its_dct_topk_all_gathers():
  # jaxcomp.demo's exchange: per 64 x 64 chunk, 32 float32 values and 32
  # int32 indices, all-gathered. For matrices whose sides are multiples of
  # the chunk the flat pricing is exact (jaxcomp.lowcomm.demo_bytes counts
  # from the shapes).
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jaxcomp import lowcomm, wire
  shapes = [(128, 256), (64, 64), (192, 64)]
  params = [jnp.zeros(s) for s in shapes]
  d = pm.DeMoCompressor()
  sizes = [a * b for a, b in shapes]
  assert sum(d.payload_bytes(n) for n in sizes) == lowcomm.demo_bytes(params)
  prof = _profile(sizes, [0.0] * 3, fwd=0.0)
  net = pm.Network(8, LINK)
  pr = pm.predict(prof, d, net, buckets="layer")
  assert pr.collective == "allgather"
  assert pr.bytes_per_worker == lowcomm.demo_bytes(params)
  ts = [t for n in sizes for t in wire.transfers("all-gather", d.payload_arrays(n), "data",
                                                 {"data": 8})]
  assert pr.comm_time == pytest.approx(sum(pm.transfer_time(t, net) for t in ts))
  assert len(ts) == 6  # values and indices: two messages per tensor
  # Keeping every coefficient, decode inverts encode (orthonormal DCT).
  full = pm.DeMoCompressor(compression_topk=64 * 64)
  x = jax.random.normal(jax.random.key(0), (5000,))
  key = jax.random.key(1)
  np.testing.assert_allclose(np.asarray(full.decode(full.encode(x, key), 5000, key)),
                             np.asarray(x), atol=1e-5)
  # With the default 32 of 4096 it keeps the largest coefficients.
  y = d.decode(d.encode(x, key), 5000, key)
  assert y.shape == (5000,) and 0 < float(jnp.linalg.norm(y)) < float(jnp.linalg.norm(x))
  with pytest.raises(ValueError, match="compression_topk must be an integer >= 1"):
    pm.DeMoCompressor(compression_topk=0)


def test_default_bucket_size_is_where_start_up_equals_transfer():
  """bucketing="auto"'s default size is the message at which a ring
  all-reduce's start-up time equals its transfer time on the network
  `jaxcomp whatif` assumes by default: half of it latency, half bytes."""
  args = cli.build_parser().parse_args(["whatif"])
  p = args.workers
  link = pm.Link.from_bandwidth(args.bandwidth, args.latency * 1e-6)
  total = pm.costs.allreduce_time(DEFAULT_BUCKET_BYTES, p, link)
  start_up = pm.costs.allreduce_time(0, p, link)
  assert (p, args.bandwidth, args.latency) == (16, 10.0, 50.0)
  assert start_up == pytest.approx(total - start_up, rel=1e-12)


def test_islands_layout_is_the_islands_step_plus_a_share_of_the_sync():
  """output="islands": the island's exact data-parallel step over the
  intra link every step, plus 1/H of each device's exchange of the whole
  pseudo-gradient across nodes (the node's g devices sharing its link);
  "islands_fsdp": the FSDP step inside, and only a shard across."""
  sizes = [4096, 64, 8192, 8]
  prof = pm.ModelProfile("t", sizes, [1e-3] * 4, 2e-3, 1e-4)
  intra, inter = pm.Link(2e-6, 1e-11), pm.Link(5e-5, 8e-10)
  g, hosts, h = 4, 2, 10
  net = pm.Network(g * hosts, inter, algorithm="hierarchical",
                   workers_per_node=g, intra=intra)
  comp = FakeCompressor(0.25)
  across = pm.Network(hosts, pm.Link(inter.alpha, inter.beta * g))
  for kind, inner_out, synced in (
      ("islands", "mean", sizes),
      ("islands_fsdp", "shard", [-(-n // g) for n in sizes])):
    pr = pm.predict(prof, comp, net, output=kind, sync_every=h)
    inner = pm.predict(prof, pm.DenseCompressor(), pm.Network(g, intra),
                       output=inner_out)
    sync = pm.predict(pm.ModelProfile("s", synced, [0.0] * 4, 0.0), comp,
                      across, overlap="serial")
    assert pr.step_time == pytest.approx(inner.step_time + sync.step_time / h)
    assert pr.bytes_per_worker == pytest.approx(
        inner.bytes_per_worker + sync.bytes_per_worker / h)
  # Each device sends a quarter across with FSDP inside (sizes divisible by g).
  rep = pm.predict(prof, comp, net, output="islands", sync_every=1)
  fsdp = pm.predict(prof, comp, net, output="islands_fsdp", sync_every=1)
  rep_in = pm.predict(prof, pm.DenseCompressor(), pm.Network(g, intra))
  fsdp_in = pm.predict(prof, pm.DenseCompressor(), pm.Network(g, intra),
                       output="shard")
  assert fsdp.bytes_per_worker - fsdp_in.bytes_per_worker == pytest.approx(
      (rep.bytes_per_worker - rep_in.bytes_per_worker) / g)
  # compare() measures the islands against data parallelism over all.
  res = pm.compare(prof, {"q": comp}, net, output="islands", sync_every=h)
  assert res["dense"].step_time == pytest.approx(
      pm.predict(prof, pm.DenseCompressor(), net).step_time)
  with pytest.raises(ValueError, match="hierarchical"):
    pm.predict(prof, comp, pm.Network(8, inter), output="islands")


def test_goodput_counts_the_lost_island_seconds():
  """perfmodel.goodput: elastic islands lose the survivors' interval and
  heartbeat wait plus the failed island's interval, restart and half an
  interval; one job loses every island's half interval and restart."""
  n, i, r, t = 4, 100.0, 600.0, 5.0
  elastic = pm.island_seconds_lost(n, i, r, heartbeat_timeout=t)
  assert elastic == pytest.approx(3 * (i + t) + i + r + i / 2)
  assert pm.island_seconds_lost(n, i, r, elastic=False) == pytest.approx(n * (i / 2 + r))
  assert pm.goodput(n, i, 0.0, r) == 1.0
  assert pm.goodput(n, i, 2.0, r, heartbeat_timeout=t) == pytest.approx(
      1 - 2.0 * elastic / 3600)
  assert pm.goodput(n, i, 100.0, r) == 0.0  # failures faster than recovery
  with pytest.raises(ValueError, match="islands must be >= 2"):
    pm.goodput(1, i, 1.0, r)
  with pytest.raises(ValueError, match="interval_seconds must be > 0"):
    pm.goodput(n, 0.0, 1.0, r)
  with pytest.raises(ValueError, match="failures_per_hour"):
    pm.goodput(n, i, -1.0, r)


def test_validation_profile_of_a_model_case():
  # validate_perfmodel.py --model: the profile the benchmark's prediction
  # splits the backward pass by has one entry per parameter leaf of the
  # model it trains. (The CNN and the char LM take longer to build than a
  # unit test may; the benchmark's runs exercise them.)
  mod = _validation_module()
  params, loss_fn, x, y, _ = mod.model_case("mlp", batch=2)
  with jax.numpy_rank_promotion("allow"):  # the benchmark's MLP adds biases by broadcasting
    prof = pm.profile(loss_fn, params, x, y, name="mlp", max_groups=1, repeats=1)
  assert prof.num_params == sum(a.size for a in jax.tree.leaves(params))
  assert len(prof.layer_sizes) == len(jax.tree.leaves(params))
  assert prof.meta["batch"] == ["float32[2, 512]", "int32[2]"]


def test_validation_nominal_link_is_the_tc_rate():
  # validate_perfmodel.py --fit nominal: no link fit, the tc rate and
  # jaxcomp whatif's assumed 50 us per message, no per-step sync.
  mod = _validation_module()
  root = os.path.join(os.path.dirname(__file__), "..")
  res = mod.load_runs([os.path.join(root, "docs", "perfmodel_validation_p2.json")])[(2, "1gbit")]
  res["rate"] = "1gbit"
  fits, preds = mod.predict_run(res, ["identity"], compute="local", fit="nominal")
  assert fits["link"] == (50e-6, 8e-9) and fits["sync"] == 0.0
  assert preds["identity"].step_time > res["local_steps"]["identity"]
