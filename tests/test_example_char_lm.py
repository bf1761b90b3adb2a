"""The character-level LM example: deterministic corpus split, a causal model,
and a short compressed run that learns and sends fewer bytes."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples.char_lm import data as data_lib
from examples.char_lm import main as main_lib
from examples.char_lm import model as model_lib
from examples.char_lm import train


@pytest.fixture(autouse=True)
def standard_promotion():
  # optax.adam mixes int32 counts and floats, which strict promotion rejects.
  with jax.numpy_dtype_promotion("standard"):
    yield


TINY = dict(context=16, d_model=32, num_layers=1, num_heads=2, batch_size=16,
            max_train_bytes=200_000, valid_windows=64, progress=False)


def test_corpus_split_is_deterministic_and_disjoint():
  files = data_lib.source_files()
  assert files == sorted(files)
  assert os.path.join(data_lib.stdlib_dir(), "os.py") in files
  train_files, valid_files = data_lib.split_files(files)
  assert not set(train_files) & set(valid_files)
  assert len(train_files) + len(valid_files) == len(files)
  assert valid_files == files[::data_lib.HELD_OUT_EVERY]
  a = data_lib.load(max_train_bytes=10_000, max_valid_bytes=5_000)
  b = data_lib.load(max_train_bytes=10_000, max_valid_bytes=5_000)
  np.testing.assert_array_equal(a.train, b.train)
  np.testing.assert_array_equal(a.valid, b.valid)
  assert a.train.shape == (10_000,) and a.valid.shape == (5_000,)
  assert a.train.min() >= 0 and a.train.max() < data_lib.VOCAB_SIZE
  # The streams are the files' bytes, in sorted order.
  with open(files[1], "rb") as f:
    head = f.read(100)
  assert bytes(a.train[:len(head)].astype(np.uint8)) == head


def test_windows():
  stream = np.arange(1000, dtype=np.int32)
  w = data_lib.random_windows(stream, 5, 17, np.random.default_rng(0))
  assert w.shape == (5, 17)
  np.testing.assert_array_equal(np.diff(w, axis=1), 1)  # consecutive bytes
  v = data_lib.fixed_windows(stream, 10, 17)
  assert v.shape == (10, 17) and len(set(v[:, 0])) == 10
  assert v[-1, -1] < 1000
  with pytest.raises(ValueError, match="too short"):
    data_lib.random_windows(stream[:10], 2, 17, np.random.default_rng(0))


def test_model_is_causal():
  m = model_lib.CharTransformer(context=16, d_model=32, num_layers=2,
                                num_heads=2)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)),
                       jnp.int32)
  params = m.init(jax.random.key(0), tokens)
  out = m.apply(params, tokens)
  assert out.shape == (2, 16, 256) and out.dtype == jnp.float32
  changed = m.apply(params, tokens.at[:, 10].set((tokens[:, 10] + 1) % 256))
  np.testing.assert_allclose(out[:, :10], changed[:, :10], atol=1e-5)
  assert float(jnp.max(jnp.abs(out[:, 10:] - changed[:, 10:]))) > 1e-4
  with pytest.raises(ValueError, match="context"):
    m.apply(params, jnp.zeros((1, 17), jnp.int32))


def test_topk_run_learns_and_sends_fewer_bytes(mesh8):
  r = train.train_and_evaluate(train.Config(
      compressor="topk", ratio=0.05, epochs=2, steps_per_epoch=15,
      learning_rate=1e-2, warmup_steps=5, **TINY))
  assert r["steps"] == 30 and len(r["epochs"]) == 2
  first, last = r["epochs"]
  # Uniform guessing over 256 bytes is 8 bits per character; source code
  # is far more predictable, even after 30 steps.
  assert last["bits_per_char"] < 6.0, r["epochs"]
  assert last["valid_loss"] < first["valid_loss"] + 0.05, r["epochs"]
  assert math.isclose(last["bits_per_char"], last["valid_loss"] / math.log(2))
  assert r["dense_bytes_per_step"] == 4 * r["num_params"]
  assert r["compression"] > 5
  # What the lowered step's collectives carry agrees with the stats (the
  # difference is the loss pmean and the non-finite check).
  assert abs(r["hlo_operand_bytes"] - r["bytes_per_step"]) <= 64


def test_main_runs_a_few_steps(mesh8, capsys):
  # Two steps: random-block 25% for one, then 10%.
  assert main_lib.main(["--compressor=random_block", "--ratio=0.1", "--epochs=1",
                        "--optimizer=momentum", "--learning-rate=0.3",
                        "--max-steps=2", "--batch-size=16", "--context=16",
                        "--d-model=32", "--layers=1", "--heads=2",
                        "--ratio-warmup-steps=1", "--no-progress"]) == 0
  out = capsys.readouterr().out
  assert "CPython" in out and "held out" in out
  assert "bits per character" in out and "bytes sent per device per step" in out
  assert "over the run, warm-up included" in out


def test_min_compress_size_keeps_small_tensors_exact(mesh8):
  small = dict(TINY, max_steps=1, epochs=1)
  every = train.train_and_evaluate(train.Config(compressor="topk", ratio=0.01, **small))
  # Every tensor below 10^9 elements (all of them) goes through the exact
  # all-reduce: the dense byte count, nothing compressed.
  exact = train.train_and_evaluate(train.Config(compressor="topk", ratio=0.01,
                                                min_compress_size=10**9, **small))
  assert exact["bytes_per_step"] == exact["dense_bytes_per_step"]
  assert every["bytes_per_step"] < every["dense_bytes_per_step"] / 5


def test_ratio_warmup_sends_each_stages_bytes(mesh8):
  # Stages of 2 steps: ratio 0.25, then 0.1 from step 2 (0.0625 < 0.1).
  r = train.train_and_evaluate(train.Config(
      compressor="topk", ratio=0.1, ratio_warmup_steps=2, epochs=1,
      steps_per_epoch=3, **TINY))
  sizes = [x.size for x in jax.tree.leaves(r["params"])]

  def topk_bytes(ratio):  # (value, index) pairs, all-gathered, per tensor
    return sum(8 * math.ceil(ratio * n) for n in sizes)

  assert r["steps"] == 3
  assert r["bytes_per_step"] == topk_bytes(0.1)
  assert r["total_bytes"] == 2 * topk_bytes(0.25) + topk_bytes(0.1)
  assert abs(r["hlo_operand_bytes"] - r["bytes_per_step"]) <= 64  # last stage
  assert np.isfinite(r["epochs"][-1]["valid_loss"])
  with pytest.raises(ValueError, match="ratio_warmup_steps"):
    train.train_and_evaluate(train.Config(
        compressor="powersgd", ratio_warmup_steps=2, **TINY))
  with pytest.raises(ValueError, match="ratio_warmup_steps"):
    train.train_and_evaluate(train.Config(
        compressor="topk", ratio_warmup_steps=-1, **TINY))


def test_bad_batch_and_compressor():
  from examples import common
  with pytest.raises(ValueError, match="optimizer"):
    common.optimizer("rmsprop", 1e-3)
  with pytest.raises(ValueError, match="batch_size"):
    train.train_and_evaluate(train.Config(batch_size=12, **{
        k: v for k, v in TINY.items() if k != "batch_size"}))
  with pytest.raises(ValueError, match="unknown compressor"):
    train.train_and_evaluate(train.Config(compressor="nope", **TINY))
  with pytest.raises(ValueError, match="lr_schedule"):
    train.train_and_evaluate(train.Config(lr_schedule="linear", **TINY))


def test_learning_rate_schedules():
  const = train.learning_rate_schedule(train.Config(
      learning_rate=0.3, warmup_steps=10, epochs=2, steps_per_epoch=50))
  cos = train.learning_rate_schedule(train.Config(
      learning_rate=0.3, warmup_steps=10, epochs=2, steps_per_epoch=50,
      lr_schedule="cosine"))
  assert float(const(0)) == float(cos(0)) == 0.0
  assert float(const(10)) == pytest.approx(0.3) and float(cos(10)) == pytest.approx(0.3)
  assert float(const(100)) == pytest.approx(0.3)
  # Cosine: half way through the decay half the peak, 0 at the last step.
  assert float(cos(55)) == pytest.approx(0.15, rel=1e-5)
  assert float(cos(100)) == pytest.approx(0.0, abs=1e-7)
  # max_steps shortens the run, and the decay with it.
  short = train.learning_rate_schedule(train.Config(
      learning_rate=0.3, warmup_steps=10, epochs=2, steps_per_epoch=50,
      lr_schedule="cosine", max_steps=30))
  assert float(short(30)) == pytest.approx(0.0, abs=1e-7)


def test_convergence_benchmark_configs():
  """benchmarks/convergence.py passes each compressor's hyperparameters to
  both examples' configs generically (no training here)."""
  import importlib.util
  import jaxcomp
  from examples import common
  from examples.fashion_mnist import train as fashion_train
  path = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                      "benchmarks", "convergence.py")
  spec = importlib.util.spec_from_file_location("convergence", path)
  conv = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(conv)
  for _, name, hp, ef, *extra in conv.SPECS:
    if name not in jaxcomp.compressors.names():
      continue
    for module in (train, fashion_train):
      config = conv._config(module, {"seed": 3, **(extra[0] if extra else {})}, name, hp, ef)
      assert config.compressor == name and config.seed == 3
      assert config.error_feedback == ef
      for field, value in (extra[0] if extra else {}).items():
        assert getattr(config, field) == value
      for k, v in hp.items():
        assert common.compressor_kwargs(config)[k] == v
  with pytest.raises(ValueError, match="takes"):
    conv._config(train, {}, "topk", {"rank": 4}, None)


def test_fsdp_and_diloco_runs_train_and_report_their_bytes_and_memory():
  # FSDP: the same training as replicated (identity), 1/8 of the memory.
  kw = dict(TINY, epochs=1, steps_per_epoch=6, compressor="identity")
  rep = train.train_and_evaluate(train.Config(**kw))
  fsdp = train.train_and_evaluate(train.Config(sharding="fsdp", **kw))
  np.testing.assert_allclose(fsdp["epochs"][0]["valid_loss"],
                             rep["epochs"][0]["valid_loss"], rtol=1e-5)
  assert fsdp["param_bytes_per_device"] * 8 >= rep["param_bytes_per_device"]
  assert fsdp["param_bytes_per_device"] * 8 < rep["param_bytes_per_device"] + 8 * 4 * 8 * 20
  # DiLoCo every 3 steps: a third of dense's bytes per step, and it learns.
  dl = train.train_and_evaluate(train.Config(diloco_every=3, **kw))
  assert dl["bytes_per_step"] == pytest.approx(rep["bytes_per_step"] / 3)
  untrained = train.train_and_evaluate(train.Config(max_steps=0, **kw))
  assert dl["epochs"][0]["valid_loss"] < untrained["epochs"][0]["valid_loss"]
  # SparseLoCo's outer step (SGD 1.0, no momentum) is another run.
  plain = train.train_and_evaluate(train.Config(
      diloco_every=3, diloco_outer_lr=1.0, diloco_outer_momentum=0.0, **kw))
  assert plain["epochs"][0]["valid_loss"] != dl["epochs"][0]["valid_loss"]
  assert plain["epochs"][0]["valid_loss"] < untrained["epochs"][0]["valid_loss"]
  with pytest.raises(ValueError, match="diloco_every"):
    train.train_and_evaluate(train.Config(diloco_every=3, sharding="fsdp", **kw))


def test_sparseloco_and_muloco_runs_train_and_count_their_bytes():
  """The sweep's SparseLoCo and MuLoCo rows as char_lm configs: chunked
  top-k with decayed error feedback and the sender mean, and Muon inside
  DiLoCo, both learn; SparseLoCo's bytes are its payload formula per sync."""
  import jaxcomp
  kw = dict(TINY, epochs=1, steps_per_epoch=6, diloco_every=3,
            diloco_outer_lr=1.0, diloco_outer_momentum=0.0)
  untrained = train.train_and_evaluate(train.Config(max_steps=0, **kw))
  sl = train.train_and_evaluate(train.Config(
      compressor="chunked_topk", topk=64, chunk=64, value_bits=2,
      error_feedback_decay=0.95, collective="sender_mean", **kw))
  assert sl["epochs"][0]["valid_loss"] < untrained["epochs"][0]["valid_loss"]
  comp = jaxcomp.compressors.get("chunked_topk")
  per_sync = sum(comp.for_shapes((p.shape,)).payload_bytes(p.size)
                 for p in jax.tree.leaves(sl["params"]))
  assert sl["bytes_per_step"] == pytest.approx(per_sync / 3)
  assert sl["wire_bytes_per_step"] == pytest.approx(7 * per_sync / 3)
  mu = train.train_and_evaluate(train.Config(
      compressor="identity", optimizer="muon", **kw))
  assert mu["epochs"][0]["valid_loss"] < untrained["epochs"][0]["valid_loss"]
  with pytest.raises(ValueError, match="error_feedback_decay=0.9 is residual"):
    train.train_and_evaluate(train.Config(compressor="topk",
                                          error_feedback="dgc",
                                          error_feedback_decay=0.9, **kw))


def test_muon_dimensions_name_the_blocks_matrices():
  params = model_lib.CharTransformer(d_model=32, num_heads=2).init(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  dims = model_lib.muon_dimensions(params)
  flat = {jax.tree_util.keystr(k): v for k, v in
          jax.tree_util.tree_flatten_with_path(
              dims, is_leaf=lambda x: x is None or isinstance(x, tuple))[0]}
  att = "['Block_0']['MultiHeadDotProductAttention_0']"
  assert flat[att + "['query']['kernel']"] == (0, (1, 2))
  assert flat[att + "['out']['kernel']"] == ((0, 1), 2)
  assert flat["['Block_0']['Dense_0']['kernel']"] == (0, 1)
  for k in ("['Embed_0']['embedding']", "['pos_embedding']",
            "['Dense_0']['kernel']", "['Block_0']['Dense_0']['bias']"):
    assert flat[k] is None, k


def test_hsdp_run_trains_as_replicated_and_reports_the_bytes_across_hosts():
  # HSDP on 2 hosts x 4 devices: identity trains as replicated data
  # parallelism; parameters take 1/4 of the replicated bytes per device;
  # int8 blocks across hosts send a shard's int8 bytes (1/4 of the
  # gradient, about 3.9x fewer than its float32).
  kw = dict(TINY, epochs=1, steps_per_epoch=6)
  rep = train.train_and_evaluate(train.Config(compressor="identity", **kw))
  hs = train.train_and_evaluate(train.Config(sharding="hsdp", compressor="identity", **kw))
  np.testing.assert_allclose(hs["epochs"][0]["valid_loss"],
                             rep["epochs"][0]["valid_loss"], rtol=1e-5)
  assert hs["param_bytes_per_device"] * 4 >= rep["param_bytes_per_device"]
  assert hs["param_bytes_per_device"] * 4 < rep["param_bytes_per_device"] + 4 * 4 * 4 * 20
  # Across hosts, dense: one float32 shard per device, a quarter of the model.
  assert hs["bytes_per_step"] == pytest.approx(rep["bytes_per_step"] / 4, rel=0.01)
  q = train.train_and_evaluate(train.Config(sharding="hsdp", compressor="int8_block",
                                            rounding="stochastic", **kw))
  assert 3.5 < q["compression"] < 4.0
  assert q["bytes_per_step"] == pytest.approx(hs["bytes_per_step"] / q["compression"])
  with pytest.raises(ValueError, match="hosts=3 must divide"):
    train.train_and_evaluate(train.Config(sharding="hsdp", hosts=3, **kw))
