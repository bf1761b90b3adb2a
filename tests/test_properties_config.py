"""Property-based tests (Hypothesis) of the public API's arguments: every
input either builds something that works or is refused at once with a
``ValueError`` / ``TypeError`` whose message names the parameter, never an
error from deep inside JAX, a hang or a silent misreading.

Profiles and the count of inputs tried: see ``tests/conftest.py``.
"""

import os
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import event, example, given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomp
from jaxcomp import bucketing, compressors, distributed
from tests.helpers import examples

# Values a caller might pass by mistake, beside the right ones.
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-2**40, 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.sampled_from([0, 1, -1, 2, 3, 4, 7, 8, 16, 128, 256, 2**31, 0.0, 0.01,
                     0.5, 1.0, 1.5, "nearest", "stochastic", "e4m3", "e5m2",
                     "pallas", "xla", "tensor", "flat", "float16", "bfloat16",
                     "float32", np.float32(0.25), np.int64(4), np.array(0.5),
                     np.array([0.5, 0.1]), jnp.float32(0.5)]),
    st.lists(st.integers(0, 3), max_size=2))


def _names_one_of(message: str, names) -> bool:
  return any(re.search(rf"\b{re.escape(n)}\b", message) for n in names)


@st.composite
def hyperparameters(draw):
  """A registered compressor name and keyword arguments for it: its own
  hyperparameters and an unknown one, with right and wrong values."""
  name = draw(st.sampled_from(compressors.names()))
  fields = compressors.hyperparameters(name)
  return name, draw(st.dictionaries(
      st.sampled_from(fields + ("not_a_field",)), JUNK, max_size=3))


# Found by this property: unhashable or array values met a dict lookup or
# a truth test before any check named them.
@example(case=("fp8_block", {"format": [0]}))
@example(case=("cast", {"dtype": [1]}))
@example(case=("random_k", {"ratio": np.array([0.5, 0.1])}))
@example(case=("int8_block", {"bits": np.array([0.5, 0.1])}))
@given(case=hyperparameters())
def test_compressor_hyperparameters_build_or_name_the_parameter(case):
  name, kwargs = case
  try:
    comp = compressors.get(name, **kwargs)
  except (ValueError, TypeError) as e:
    assert _names_one_of(str(e), kwargs), (kwargs, e)
    # compressed_mean refuses it the same way, at construction.
    with pytest.raises(type(e)):
      jaxcomp.compressed_mean(name, "data", **kwargs)
    return
  for k, v in kwargs.items():  # kept as given, not silently replaced
    assert getattr(comp, k) is v, (k, v)


@example(min_compress_size=None)
@example(min_compress_size=1.5)
@example(min_compress_size="8")
@given(min_compress_size=JUNK)
def test_min_compress_size_is_an_integer_or_refused(min_compress_size):
  ok = (isinstance(min_compress_size, (int, np.integer))
        and not isinstance(min_compress_size, bool) and min_compress_size >= 0)
  if ok:
    jaxcomp.compressed_mean("topk", "data", min_compress_size=min_compress_size)
  else:
    with pytest.raises((ValueError, TypeError), match="min_compress_size"):
      jaxcomp.compressed_mean("topk", "data",
                              min_compress_size=min_compress_size)


AXES = st.one_of(
    st.sampled_from(["data", ("data",), ("hosts", "devices")]),
    st.sampled_from(["", (), ("data", "data"), ("data", ""), None, 3,
                     ["data"], ("data", 3), b"data"]))


@given(axis_name=AXES)
def test_axis_names_are_checked_at_construction(axis_name):
  names = (axis_name,) if isinstance(axis_name, str) else axis_name
  good = (isinstance(axis_name, (str, tuple, list)) and len(names) > 0
          and all(isinstance(a, str) and a for a in names)
          and len(set(names)) == len(names))
  builders = [
      lambda: jaxcomp.compressed_mean("topk", axis_name),
      lambda: jaxcomp.multi_steps(optax.sgd(0.1), 2, axis_name),
      lambda: jaxcomp.apply_if_finite(optax.sgd(0.1), axis_name),
      lambda: jaxcomp.diloco(optax.sgd(0.1), sync_every=2,
                             axis_name=axis_name),
  ]
  for build in builders:
    if good:
      build()
    else:
      with pytest.raises(ValueError, match="axis_name"):
        build()


# Each argument of compressed_mean: values that make sense, and mistakes.
CONSTRUCTOR = dict(
    compressor=(st.sampled_from(compressors.names()),
                st.sampled_from(["nope", "", None, 3])),
    collective=(st.one_of(st.none(), st.none(),
                          st.sampled_from(jaxcomp.collectives.names())),
                st.sampled_from(["nope", 3, ""])),
    error_feedback=(st.sampled_from([None, True, False,
                                     *jaxcomp.feedback.names()]),
                    st.sampled_from(["nope", 1, 0.5])),
    bucketing=(st.sampled_from(["auto", "layerwise", "whole", "fixed",
                                "fixed_bytes"]),
               st.sampled_from(["mgwfbp", "nope", None])),
    bucket_elements=(st.integers(1, 64), st.one_of(st.integers(-3, 0), JUNK)),
    bucket_bytes=(st.integers(1, 256), st.one_of(st.integers(-3, 0), JUNK)),
    nonfinite=(st.sampled_from(["skip", "zero", "propagate"]),
               st.sampled_from(["nan", None, "Skip"])),
    output=(st.sampled_from(["mean", "mean", "shard"]),
            st.sampled_from(["whole", None])),
    seed=(st.integers(0, 2**32 - 1), st.one_of(
        st.integers(-2**70, -1), st.integers(2**64, 2**70), JUNK)),
)


@st.composite
def constructor_args(draw):
  """compressed_mean's arguments, each right or (rarely, one or two at a
  time) a mistake."""
  wrong = (draw(st.sets(st.sampled_from(sorted(CONSTRUCTOR)), min_size=1,
                        max_size=2)) if draw(st.booleans()) else set())
  kwargs = {k: draw(bad if k in wrong else good, label=k)
            for k, (good, bad) in CONSTRUCTOR.items()}
  if "bucket_elements" not in wrong and kwargs["bucketing"] != "fixed":
    kwargs["bucket_elements"] = None
  if "bucket_bytes" not in wrong and kwargs["bucketing"] != "fixed_bytes":
    # "auto" reads it too (but not for compressors bound to one tensor's
    # shape, which stay one bucket per leaf and refuse it by name).
    if kwargs["bucketing"] != "auto" or not draw(st.booleans()):
      kwargs["bucket_bytes"] = None
  return kwargs


# What names each argument in an error message (its name, or the words of
# the registry message for unknown names).
MESSAGE_NAMES = {"compressor": ("compressor",),
                 "collective": ("collective",),
                 "error_feedback": ("error_feedback",),
                 "bucketing": ("bucketing", "plan"),
                 "bucket_elements": ("bucket_elements",),
                 "bucket_bytes": ("bucket_bytes",),
                 "nonfinite": ("nonfinite",),
                 "output": ("output",), "seed": ("seed",)}


def _trace_update(tx, params, mesh, axis="data"):
  """``init`` and one ``update`` traced abstractly (no compile) under
  ``shard_map``, with per-device gradients: every trace-time check runs."""
  def body(g):
    state = tx.init(params)
    grads = jaxcomp.placement.to_varying(jax.tree.map(lambda x: x[0], g), axis)
    return tx.update(grads, state, params)[0]

  stacked = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct((mesh.size,) + x.shape, x.dtype,
                                     sharding=NamedSharding(mesh, P(axis))),
      params)
  f = jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(),
                    check_vma=False)
  return jax.eval_shape(f, stacked)


# Leaves beside the two float32 ones: zero-size (no element to compress),
# and of other floating dtypes (a bucket of mixed dtypes travels in float32).
EXTRA_LEAVES = st.lists(st.tuples(
    st.sampled_from([(0,), (0, 3), (3, 0, 2), (4,), (2, 3)]),
    st.sampled_from(["float32", "bfloat16", "float16"])), max_size=3)


@settings(max_examples=examples(1.0))
@given(kwargs=constructor_args(), extra=EXTRA_LEAVES)
def test_compressed_mean_builds_and_traces_or_names_the_parameter(mesh8,
                                                                  kwargs,
                                                                  extra):
  try:
    tx = jaxcomp.compressed_mean(axis_name="data", **kwargs)
  except (ValueError, TypeError) as e:
    given_names = [w for k in kwargs for w in MESSAGE_NAMES[k]]
    assert _names_one_of(str(e), given_names), (kwargs, e)
    event("refused")
    return
  event("built")
  if kwargs["output"] == "shard":
    return  # traced by the FSDP properties (flat shards)
  params = {"w": jnp.zeros((6, 5), jnp.float32), "b": jnp.zeros((7,)),
            **{f"x{i}": jnp.zeros(shape, dtype)
               for i, (shape, dtype) in enumerate(extra)}}
  out = _trace_update(tx, params, mesh8)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), out) == jax.tree.map(
      lambda x: (x.shape, x.dtype), params)


SIZES = st.lists(st.one_of(st.integers(0, 3), st.sampled_from(
    [5, 7, 13, 31, 127, 4096, 65537, 2**31 - 1, 2**31, 2**31 + 1, 2**40])),
                 max_size=12)


@given(sizes=SIZES, strategy=st.sampled_from(
    ["auto", "layerwise", "whole", "fixed", "fixed_bytes"]),
       min_size=st.integers(0, 200), limit=st.integers(1, 2**33),
       kinds=st.lists(st.sampled_from("ab"), min_size=12, max_size=12))
def test_bucket_plans_partition_the_leaves(sizes, strategy, min_size, limit,
                                           kinds):
  plan = bucketing.plan_buckets(
      sizes, strategy=strategy, min_size=min_size,
      bucket_elements=limit if strategy == "fixed" else None,
      bucket_bytes=limit if strategy in ("fixed_bytes", "auto") else None,
      kinds=kinds if strategy == "auto" else None)
  flat = [i for b in plan.buckets for i in b]
  # Every leaf exactly once, small ones exact, buckets in leaf order.
  assert sorted([*plan.exact, *flat]) == list(range(len(sizes)))
  assert list(plan.exact) == [i for i, s in enumerate(sizes)
                              if s < max(min_size, 1)]
  big = [i for i, s in enumerate(sizes) if s >= max(min_size, 1)]
  # In leaf order ("auto": each bucket's leaves in leaf order, the small
  # ones packed past the large ones between them).
  assert (sorted(flat) if strategy == "auto" else flat) == big
  assert all(list(b) == sorted(b) for b in plan.buckets), plan
  assert all(plan.buckets), plan
  if strategy == "layerwise":
    assert all(len(b) == 1 for b in plan.buckets)
  elif strategy == "whole":
    assert len(plan.buckets) == (1 if flat else 0)
  elif strategy == "auto":
    elements = -(-limit // 4)
    short = {}
    for b in plan.buckets:
      # A leaf of a full bucket's size is alone; smaller ones share a kind,
      # and a packed bucket is closed as soon as it is full.
      if any(sizes[i] >= elements for i in b):
        assert len(b) == 1, (b, plan)
        continue
      assert len({kinds[i] for i in b}) == 1, (b, plan)
      assert sum(sizes[i] for i in b[:-1]) < elements, (b, plan)
      if sum(sizes[i] for i in b) < elements:
        # At most one bucket per kind is left short: the last one.
        assert kinds[b[0]] not in short, (b, plan)
        short[kinds[b[0]]] = b
    # The small leaves of a kind fill its buckets in leaf order.
    for kind in set(kinds[i] for i in big if sizes[i] < elements):
      packed = [i for b in plan.buckets if len(b) > 1 or sizes[b[0]] < elements
                for i in b if kinds[i] == kind]
      assert packed == [i for i in big if kinds[i] == kind
                        and sizes[i] < elements], plan
  else:
    elements = limit if strategy == "fixed" else -(-limit // 4)
    for b in plan.buckets[:-1]:  # full, and closed as soon as full
      total = sum(sizes[i] for i in b)
      assert total >= elements and total - sizes[b[-1]] < elements, (b, plan)


@example(sizes=[4, 4], plan=[0, 1], strategy="layerwise",
         bucket_elements=None)  # a flat list, not lists of indices
@example(sizes=[4, 2.5], plan=None, strategy="layerwise",
         bucket_elements=None)  # a fractional leaf size
@example(sizes=[4, -3], plan=None, strategy="layerwise",
         bucket_elements=None)
@example(sizes=[], plan=np.array(0.5), strategy=None,
         bucket_elements=None)  # a 0-d array: iterable by type, not in fact
@given(sizes=st.lists(st.one_of(st.integers(-2, 50), JUNK), max_size=5),
       plan=st.one_of(st.none(), JUNK, st.lists(
           st.one_of(st.lists(st.integers(-1, 6), max_size=3), JUNK),
           max_size=3)),
       strategy=st.one_of(st.sampled_from(bucketing.STRATEGIES), JUNK),
       bucket_elements=st.one_of(st.none(), JUNK))
def test_bucket_plan_input_is_used_or_refused_by_name(sizes, plan, strategy,
                                                      bucket_elements):
  try:
    out = bucketing.plan_buckets(sizes, strategy=strategy, plan=plan,
                                 bucket_elements=bucket_elements)
  except (ValueError, TypeError) as e:
    assert _names_one_of(str(e), ["sizes", "plan", "bucketing",
                                  "bucket_elements", "strategy"]), e
    return
  # Accepted: the leaf sizes were whole numbers >= 0 and the plan lists of
  # distinct indices, each leaf placed once.
  assert all(float(s) == int(s) and int(s) >= 0 for s in sizes), sizes
  flat = [i for b in out.buckets for i in b]
  assert sorted([*out.exact, *flat]) == list(range(len(sizes)))


@given(sync_every=JUNK, fragments=st.one_of(st.integers(-1, 6), JUNK),
       overlap_steps=st.one_of(st.integers(-1, 6), JUNK),
       merge=st.one_of(st.floats(-1, 2), JUNK),
       leaves=st.integers(1, 4))
def test_diloco_arguments_work_or_name_the_parameter(
    mesh8, sync_every, fragments, overlap_steps, merge, leaves):
  try:
    tx = jaxcomp.diloco(optax.sgd(0.1), sync_every=sync_every,
                        fragments=fragments, overlap_steps=overlap_steps,
                        merge=merge)
  except (ValueError, TypeError) as e:
    assert _names_one_of(str(e), ["sync_every", "fragments",
                                  "overlap_steps", "merge"]), e
    return
  params = {f"w{i}": jax.ShapeDtypeStruct((3,), jnp.float32,
                                          sharding=NamedSharding(mesh8, P()))
            for i in range(leaves)}
  init = jax.shard_map(tx.init, mesh=mesh8, in_specs=P(), out_specs=P(),
                       check_vma=False)  # traced only: the init's shapes
  if fragments > leaves:  # found in init, naming it
    with pytest.raises(ValueError, match="fragments"):
      jax.eval_shape(init, params)
    return
  state = jax.eval_shape(init, params)
  assert len(state.outer_state) == fragments


@given(every_k=JUNK, max_errors=JUNK)
def test_accumulation_and_skip_counts_work_or_name_the_parameter(
    every_k, max_errors):
  for build, name, value, ok in [
      (lambda: jaxcomp.multi_steps(optax.sgd(0.1), every_k), "every_k",
       every_k, lambda v: v >= 1),
      (lambda: jaxcomp.apply_if_finite(optax.sgd(0.1), "data", max_errors),
       "max_consecutive_errors", max_errors, lambda v: v >= 0)]:
    integer = (isinstance(value, (int, np.integer))
               and not isinstance(value, bool))
    if (integer and ok(value)) or (value is None and name != "every_k"):
      build()
    else:
      with pytest.raises((ValueError, TypeError), match=name):
        build()


ADDRESSES = st.one_of(st.sampled_from(
    ["127.0.0.1:1234", "host:1", "[::1]:80", "h:65535"]), st.text(max_size=12))


# Found by this property (thorough profile): a NumPy integer process count
# passed the checks and reached JAX, which takes Python ints only.
@example(address="127.0.0.1:1234", num_processes=np.int64(4), process_id=0,
         heartbeat=None)
@given(address=st.one_of(st.none(), ADDRESSES),
       num_processes=st.one_of(st.none(), st.integers(-1, 4), JUNK),
       process_id=st.one_of(st.none(), st.integers(-1, 4), JUNK),
       heartbeat=st.one_of(st.none(), st.integers(-1, 30), JUNK))
def test_initialize_from_env_input_is_used_or_refused_by_name(
    address, num_processes, process_id, heartbeat):
  """The job parameters (as flags would give them) reach
  ``jax.distributed.initialize`` only when they make a job; otherwise a
  ``ValueError``/``TypeError`` names them. ``jax.distributed.initialize``
  is replaced by a recorder (no real job starts)."""
  calls = []
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAXCOMP_", "SLURM_"))}
  with mock.patch.object(jax.distributed, "initialize",
                         lambda **kw: calls.append(kw)), \
       mock.patch.object(jax.distributed, "is_initialized", lambda: False), \
       mock.patch.dict(os.environ, env, clear=True):
    try:
      joined = distributed.initialize_from_env(
          address, num_processes, process_id,
          heartbeat_timeout_seconds=heartbeat, cpu_collectives=None,
          watch_peers=False, auto_detect=False)
    except (ValueError, TypeError) as e:
      assert _names_one_of(str(e), [
          "coordinator", "address", "num_processes", "process_id",
          "heartbeat_timeout_seconds"]), e
      return
  if not joined:
    assert calls == [] and not address and num_processes is None
    return
  (kw,) = calls
  host, _, port = kw["coordinator_address"].rpartition(":")
  assert host and 1 <= int(port) <= 65535
  assert isinstance(kw["num_processes"], int)
  assert 0 <= kw["process_id"] < kw["num_processes"]
  assert kw["heartbeat_timeout_seconds"] >= 1


BIG = st.sampled_from([2**31 - 1, 2**31, 2**31 + 1, 2**32 + 3, 3 * 2**31])


@pytest.mark.parametrize("name", compressors.names())
@given(leaf=BIG)
def test_buffers_past_int32_are_refused_or_sized_exactly(name, leaf):
  """A bucket of 2^31 - 1 elements or more (abstract shapes only: nothing
  is allocated): a compressor that addresses elements with int32 indices
  refuses more than 2^31 - 1, saying what to do; the bytes it would send
  are sized with exact integer arithmetic."""
  comp = compressors.get(name)
  if comp.max_elements is not None and leaf > comp.max_elements:
    assert comp.max_elements == 2**31 - 1
    with pytest.raises(ValueError, match=r"2\*\*31 - 1.*mask="):
      comp.check_size(leaf)
    return
  comp.check_size(leaf)  # identity and the casts: any size
  assert name in ("identity", "cast", "bf16", "fp16") or leaf < 2**31
  coll = jaxcomp.collectives.get(None, comp)
  sent = coll.payload_bytes(comp, ((leaf,),), {"data": 8}, jnp.float32)
  assert isinstance(sent, int) and sent > 0
  if name == "identity":
    assert sent == 4 * leaf and comp.payload_arrays(leaf) == (4 * leaf,)


@pytest.mark.parametrize("name", ["topk", "int8_block", "identity", "qsgd",
                                  "random_k", "sign", "powersgd", "bf16"])
@given(leaf=st.sampled_from([2**31 + 1, 2**32 + 3]))
def test_transform_init_past_int32_is_refused_or_traced(mesh8, name, leaf):
  """``compressed_mean``'s init on a leaf of more than 2^31 elements
  (abstract): refused by name where the compressor takes no such bucket,
  else traced without an integer overflow, its residual the leaf's size."""
  tx = jaxcomp.compressed_mean(name, "data")
  params = {"w": jax.ShapeDtypeStruct((leaf,), jnp.float32)}
  init = jax.shard_map(lambda p: tx.init(p), mesh=mesh8, in_specs=P(),
                       out_specs=P(), check_vma=False)
  if compressors.get(name).max_elements is not None:
    with pytest.raises(ValueError, match=r"2\*\*31 - 1"):
      jax.eval_shape(init, params)
    return
  state = jax.eval_shape(init, params)
  residual = jax.tree.leaves(state.feedback)
  assert all(r.shape == (leaf,) for r in residual), residual
