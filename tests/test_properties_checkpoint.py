"""Property-based test (Hypothesis) of the checkpoint restore path with
damaged or foreign files: whatever is deleted, truncated, overwritten or
added, ``Checkpointer.restore`` returns a saved state bit for bit (the
newest complete step, with a warning when it falls back) or raises
``CheckpointDamagedError`` / ``CheckpointMismatchError`` /
``FileNotFoundError`` naming the checkpoint, never another error and
never a state that differs from what was saved.

Profiles and the count of inputs tried: see ``tests/conftest.py``.
"""

import json
import os
import shutil
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given, settings, strategies as st

import jaxcomp
from jaxcomp import checkpoint
from tests.helpers import examples

pytest.importorskip("orbax.checkpoint")


@pytest.fixture(scope="module")
def saved(mesh8, tmp_path_factory):
  """Steps 1 and 2 of a top-k + error feedback + momentum state (different
  values), saved once; each example damages a copy. The parameters hold a
  bfloat16 leaf beside the float32 ones (mixed dtypes: the transform packs
  them apart). No zero-size leaf: Orbax refuses to save one ("Cannot save
  arrays with zero size"), before any damage."""
  tx = optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.25),
                   optax.sgd(1e-2, momentum=0.9))
  params = {"w": jnp.zeros((6, 4)), "b": jnp.zeros((4,)),
            "h": jnp.zeros((5,), jnp.bfloat16)}
  state, _ = jaxcomp.placement.init_sharded(tx, params, mesh8, "data")
  template = {"params": params, "opt_state": state}
  root = str(tmp_path_factory.mktemp("ckpt") / "template")
  states = {}
  with checkpoint.Checkpointer(root) as ckpt:
    for step in (1, 2):
      rng = np.random.default_rng(step)
      # New values for every leaf but the uint32 ones (the transform's
      # configuration digest and its key).
      states[step] = jax.tree.map(
          lambda x, rng=rng: x if x.dtype == jnp.uint32 else jax.device_put(
              jnp.asarray(rng.integers(0, 2**16, x.shape), x.dtype)
              if jnp.issubdtype(x.dtype, jnp.integer) else
              jnp.asarray(rng.standard_normal(x.shape), x.dtype),
              x.sharding), template)
      ckpt.save(step, states[step])
  files = sorted(os.path.relpath(os.path.join(d, f), root)
                 for d, _, fs in os.walk(root) for f in fs)
  return root, template, states, files


def _apply(root, files, damage):
  """Applies one damage ``(kind, index, amount)`` to the copy at ``root``."""
  kind, index, amount = damage
  path = os.path.join(root, files[index % len(files)])
  if kind in ("delete", "truncate", "flip", "append", "junk") and not (
      os.path.exists(path)):
    return
  if kind == "delete":
    os.remove(path)
  elif kind == "truncate":
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
      f.truncate(int(size * amount))
  elif kind == "flip":  # same size, one byte changed
    size = os.path.getsize(path)
    if size:
      with open(path, "r+b") as f:
        f.seek(int((size - 1) * amount))
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
  elif kind == "append":
    with open(path, "ab") as f:
      f.write(b"\0" * (1 + int(100 * amount)))
  elif kind == "junk":  # the same size, other contents
    size = os.path.getsize(path)
    with open(path, "wb") as f:
      f.write(bytes((i * 37 + 11) % 256 for i in range(size)))
  elif kind == "foreign_file":  # a file nobody wrote, next to the data
    where = os.path.dirname(path)
    with open(os.path.join(where, f"stray_{int(amount * 1000)}.bin"),
              "wb") as f:
      f.write(b"not a checkpoint")
  elif kind == "foreign_step":  # a folder named like a step
    name = ["3", "7", "2.orbax-checkpoint-tmp-1", "abc"][index % 4]
    os.makedirs(os.path.join(root, name), exist_ok=True)
    with open(os.path.join(root, name, "junk.json"), "w") as f:
      f.write("{" if amount < 0.5 else json.dumps({"step": 9}))
  elif kind == "metadata":  # jaxcomp's JSON record replaced
    step = ["1", "2"][index % 2]
    meta = os.path.join(root, step, "jaxcomp", "metadata")
    if os.path.exists(meta):
      with open(meta, "w") as f:
        f.write(["", "{", "[]", json.dumps({"format": 99})][
            int(amount * 3.99)])


DAMAGE = st.tuples(
    st.sampled_from(["delete", "truncate", "flip", "append", "junk",
                     "foreign_file", "foreign_step", "metadata"]),
    st.integers(0, 10**6), st.floats(0, 1))
ERRORS = (checkpoint.CheckpointDamagedError,
          checkpoint.CheckpointMismatchError, FileNotFoundError)


def _same(a, b):
  return all(np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# Found by this property: a data file overwritten with other bytes of the
# same size passed the size check and restored other values.
@example(damages=[("junk", 0, 0.5)], named_step=False)
@settings(max_examples=examples(0.3))
@given(damages=st.lists(DAMAGE, min_size=1, max_size=3),
       named_step=st.booleans())
def test_damaged_or_foreign_files_restore_exactly_or_are_refused(
    saved, damages, named_step):
  root, template, states, files = saved
  with tempfile.TemporaryDirectory() as tmp:
    copy = os.path.join(tmp, "ckpt")
    shutil.copytree(root, copy)
    for d in damages:
      _apply(copy, files, d)
    try:
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with checkpoint.Checkpointer(copy) as ckpt:
          step, state = ckpt.restore(template,
                                     step=2 if named_step else None)
    except ERRORS as e:
      assert copy in str(e) or "step" in str(e), e
      return
  assert step in (1, 2)
  assert _same(state, states[step]), (step, damages)
  if named_step:
    assert step == 2
  elif step == 1:  # fell back: said so
    assert any("restoring step 1" in str(w.message) for w in caught), caught
