"""Chunked top-k (SparseLoCo's compressor): bit-packed indices within a
chunk, the reference's statistical 2-bit quantizer, and one SparseLoCo sync
of jaxcomp.diloco against a NumPy transcription of the reference's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomp
from jaxcomp import lowcomm
from jaxcomp.compressors import chunked_topk
from jaxcomp.kernels import bitpack


# -- packing at any width ------------------------------------------------------


def _stream_words(codes, bits):
  """The little-endian bit stream of ``codes`` as uint32 words (NumPy)."""
  n_words = -(-len(codes) * bits // 32)
  stream = np.zeros(max(n_words, 1) * 32, np.uint64)
  for j, v in enumerate(codes):
    for t in range(bits):
      stream[j * bits + t] = (int(v) >> t) & 1
  return np.array([int(sum(int(stream[32 * i + t]) << t for t in range(32)))
                   for i in range(n_words)], np.uint64).astype(np.uint32)


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 6, 7, 12, 13, 16, 20, 31, 32])
@pytest.mark.parametrize("n", [0, 1, 9, 100])
def test_pack_codes_is_the_bit_stream_at_any_width(bits, n):
  rng = np.random.default_rng(bits * 1000 + n)
  codes = rng.integers(0, 2 ** bits, size=n, dtype=np.uint64).astype(np.uint32)
  words = bitpack.pack_codes(jnp.asarray(codes), bits)
  assert words.dtype == jnp.uint32
  assert words.shape == (bitpack.code_words(n, bits),) == (-(-n * bits // 32),)
  np.testing.assert_array_equal(np.asarray(words), _stream_words(codes, bits))
  np.testing.assert_array_equal(
      np.asarray(bitpack.unpack_codes(words, bits, n)), codes)
  if bits in bitpack.SUPPORTED_BITS:  # the layout every quantizer uses
    np.testing.assert_array_equal(
        np.asarray(words), np.asarray(bitpack.pack_bits_reference(
            jnp.asarray(codes), bits)))


def test_pack_codes_refuses_bad_widths():
  for bits in (0, 33, 2.5, True):
    with pytest.raises(ValueError, match="bits must be an integer in"):
      bitpack.pack_codes(jnp.zeros((4,), jnp.uint32), bits)
  with pytest.raises(ValueError, match="words must have shape"):
    bitpack.unpack_codes(jnp.zeros((3,), jnp.uint32), 12, 4)


# -- the compressor -------------------------------------------------------------


def _smaller_split(n, close_to):
  return n if n <= close_to else max(d for d in range(1, close_to + 1)
                                     if n % d == 0)


def test_chunks_indices_and_bytes_at_sparselocos_setting():
  comp = jaxcomp.compressors.get("chunked_topk").for_shapes(((256, 128),))
  n = 256 * 128
  c = comp.chunks(n)
  assert (c.h, c.w, c.k, c.count) == (64, 64, 64, 8)
  assert comp.index_bits(n) == 12
  k_all = 8 * 64
  # 12-bit indices, 2-bit codes, a 4-entry lookup table and the shift.
  assert comp.payload_arrays(n) == (4 * k_all * 2 // 32, 4 * k_all * 12 // 32,
                                    16, 4)
  assert comp.payload_bytes(n) == 8 * 112 + 20  # 112 bytes a chunk
  # A 1-D tensor: chunks of up to 64, one entry each (round(64 * 64 / 4096)).
  vec = comp.for_shapes(((128,),))
  assert vec.chunks(128)[2:] == (1, 64, 1) and vec.index_bits(128) == 6


@pytest.mark.parametrize("shape,chunk,topk", [((12, 10), 4, 6), ((12,), 4, 6),
                                              ((4, 3, 6), 4, 5),
                                              ((128, 64), 64, 64)])
def test_sends_each_chunks_largest_entries(shape, chunk, topk):
  comp = jaxcomp.compressors.get("chunked_topk", topk=topk, chunk=chunk,
                                 value_bits=None).for_shapes((shape,))
  n = int(np.prod(shape))
  x = np.asarray(jax.random.normal(jax.random.key(3), (n,)), np.float32)
  got = np.asarray(comp.decode(comp.encode(jnp.asarray(x), None), n, None))
  # NumPy: the tensor as (rows, cols), cut into h x w tiles.
  rows, cols = (1, n) if len(shape) == 1 else (shape[0], n // shape[0])
  h = 1 if len(shape) == 1 else _smaller_split(rows, chunk)
  w = _smaller_split(cols, chunk)
  k = max(1, min(h * w, round(h * w * topk / chunk ** 2)))
  want = np.zeros((rows, cols), np.float32)
  xm = x.reshape(rows, cols)
  for a in range(0, rows, h):
    for b in range(0, cols, w):
      tile = xm[a:a + h, b:b + w].reshape(-1)
      keep = np.argsort(-np.abs(tile), kind="stable")[:k]
      sent = np.zeros_like(tile)
      sent[keep] = tile[keep]
      want[a:a + h, b:b + w] = sent.reshape(h, w)
  np.testing.assert_array_equal(got, want.reshape(-1))
  assert comp.capacity(n) == (rows // h) * (cols // w) * k


def _quantize_reference(val, n_bins, range_in_sigmas):
  """tplr-ai/SparseLoCo's TopKCompressor._quantize and _dequantize (NumPy,
  float32): the dequantized values."""
  offset = n_bins // 2
  shift = val.mean(dtype=np.float32)
  centered = (val - shift).astype(np.float32)
  std = (np.float32(np.linalg.norm(centered)) / np.float32(np.sqrt(len(val) - 1))
         if len(val) > 1 else np.float32(0))
  scale = np.float32(range_in_sigmas) * std / np.float32(n_bins)
  if scale == 0 or not np.isfinite(scale):
    scale = np.float32(1.0)
  q = np.clip(np.round(centered / scale + offset), 0, n_bins - 1).astype(int)
  sums = np.zeros(n_bins, np.float32)
  counts = np.zeros(n_bins, np.float32)
  np.add.at(sums, q, centered)
  np.add.at(counts, q, 1.0)
  lookup = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0).astype(np.float32)
  return lookup[q] + shift


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_statistical_quantizer_is_the_references(bits):
  v = np.asarray(jax.random.normal(jax.random.key(bits), (300,)), np.float32)
  v = v * np.float32(0.01) + np.float32(0.002)
  payload = chunked_topk.quantize_statistical(jnp.asarray(v), bits, 6.0)
  assert payload["codes"].shape == (bitpack.code_words(300, bits),)
  got = np.asarray(chunked_topk.dequantize_statistical(payload, bits, 300))
  np.testing.assert_allclose(got, _quantize_reference(v, 2 ** bits, 6.0),
                             rtol=2e-6, atol=1e-9)
  # Each bin decodes to the mean of its members: the error sums to zero
  # per bin, so in all.
  assert abs(float(np.sum(got - v))) < 1e-5 * float(np.sum(np.abs(v)))


def test_refuses_bad_input():
  for kw, match in [(dict(topk=0), "topk must be an integer >= 1"),
                    (dict(chunk=2.0), "chunk must be an integer >= 1"),
                    (dict(value_bits=3), "value_bits must be one of"),
                    (dict(range_sigmas=0.0), "range_sigmas must be a finite")]:
    with pytest.raises(ValueError, match=match):
      jaxcomp.compressors.get("chunked_topk", **kw)
  comp = jaxcomp.compressors.get("chunked_topk")
  with pytest.raises(ValueError, match="bucketing='layerwise'"):
    comp.for_shapes(((4, 4), (3,)))
  with pytest.raises(ValueError, match="bucketing='layerwise'"):
    jaxcomp.compressed_mean("chunked_topk", "data", bucketing="whole")
  with pytest.raises(ValueError, match=r"bound to shape \(4, 4\) got n=15"):
    comp.for_shapes(((4, 4),)).encode(jnp.zeros((15,)), None)


# -- one SparseLoCo sync against the reference's ---------------------------------


def _chunk_view(x, chunk):
  """The reference's ChunkingTransform.encode: 2-D as (y, x, h, w), 1-D as
  (x, w); returned with the inverse."""
  if x.ndim == 1:
    w = _smaller_split(x.shape[0], chunk)
    return x.reshape(-1, 1, 1, w), lambda t: t.reshape(-1)
  rows, cols = x.shape
  h, w = _smaller_split(rows, chunk), _smaller_split(cols, chunk)
  v = x.reshape(rows // h, h, cols // w, w).transpose(0, 2, 1, 3)
  return v, lambda t: t.transpose(0, 2, 1, 3).reshape(rows, cols)


def _sparseloco_reference_sync(theta, pseudo, error, *, lr, decay, topk, chunk,
                               n_bins, range_sigmas):
  """tplr-ai/SparseLoCo's SparseLoCo.step for one tensor on R workers, in
  NumPy float32: worker r's gradient is its pseudo-gradient ``pseudo[r]``
  and its error buffer ``error[r]``. Returns the new parameters and error
  buffers."""
  r_workers = pseudo.shape[0]
  error = (np.float32(decay) * error + np.float32(lr) * pseudo).astype(np.float32)
  sent = []
  for r in range(r_workers):
    chunks, back = _chunk_view(error[r], chunk)
    y, x, h, w = chunks.shape
    flat = chunks.reshape(y, x, h * w)
    k = max(1, min(h * w, int(round(h * w * topk / chunk ** 2))))
    idx = np.argsort(-np.abs(flat), axis=-1, kind="stable")[..., :k]
    val = np.take_along_axis(flat, idx, axis=-1)
    if n_bins:
      val = _quantize_reference(val.reshape(-1), n_bins, range_sigmas).reshape(val.shape)
    recon = np.zeros_like(flat)
    np.put_along_axis(recon, idx, val, axis=-1)
    error[r] = error[r] - back(recon.reshape(y, x, h, w))
    sent.append((idx, val))
  # batch_decompress: scatter_reduce(mean, include_self=False) of every
  # worker's entries, chunk by chunk.
  chunks, back = _chunk_view(theta, chunk)
  y, x, h, w = chunks.shape
  sums = np.zeros((y, x, h * w), np.float32)
  counts = np.zeros((y, x, h * w), np.float32)
  for idx, val in sent:
    for a in range(y):
      for b in range(x):
        np.add.at(sums[a, b], idx[a, b], val[a, b])
        np.add.at(counts[a, b], idx[a, b], 1.0)
  agg = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0).astype(np.float32)
  return (theta - np.float32(lr) * back(agg.reshape(y, x, h, w))).astype(np.float32), error


@pytest.mark.parametrize("shapes,chunk,topk,value_bits", [
    ({"b": (12,), "w": (12, 10)}, 4, 6, 2),
    ({"b": (64,), "w": (128, 64)}, 64, 64, 2),
    ({"b": (12,), "w": (12, 10)}, 4, 6, None),
])
def test_sparseloco_sync_is_the_references(mesh8, shapes, chunk, topk,
                                           value_bits):
  """Two syncs (H = 1, inner SGD 1.0 so that the pseudo-gradient is the
  gradient given) of jaxcomp.diloco with SparseLoCo's parts -- chunked
  top-k, error feedback with decay 0.95, no outer momentum (outer SGD 1.0),
  the sender-mean collective -- give the reference's parameters and error
  buffers on every device."""
  decay = 0.95
  tx = jaxcomp.diloco(
      optax.sgd(1.0), optax.sgd(1.0), sync_every=1, compressor="chunked_topk",
      topk=topk, chunk=chunk, value_bits=value_bits,
      error_feedback=jaxcomp.feedback.ResidualFeedback(decay=decay),
      collective="sender_mean")
  rng = np.random.default_rng(7)
  theta = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
  state = jaxcomp.init(tx, jax.tree.map(jnp.asarray, theta), mesh8,
                       layout=jaxcomp.Islands())
  grads_of = [{k: (rng.normal(size=(8,) + s) * 0.01).astype(np.float32)
               for k, s in shapes.items()} for _ in range(2)]

  # A loss whose gradient on each device is the gradient given to it.
  loss = lambda p, g: sum(jnp.vdot(p[k], g[k][0]) for k in p)
  step = jaxcomp.make_train_step(loss, tx, mesh=mesh8, layout=jaxcomp.Islands())
  error = {k: np.zeros((8,) + s, np.float32) for k, s in shapes.items()}
  for g in grads_of:
    state, _ = step(state, jax.device_put(g, NamedSharding(mesh8, P("data"))))
    for k in shapes:
      # The pseudo-gradient as the step forms it: anchor - (anchor - g).
      pseudo = (theta[k][None] - (theta[k][None] - g[k])).astype(np.float32)
      theta[k], error[k] = _sparseloco_reference_sync(
          theta[k], pseudo, error[k], lr=1.0, decay=decay, topk=topk,
          chunk=chunk, n_bins=value_bits and 2 ** value_bits, range_sigmas=6.0)
  synced = lowcomm.synced_params(state.opt_state)
  feedback = state.opt_state.exchange_state[0].feedback  # per leaf, sorted: b, w
  for i, k in enumerate(sorted(shapes)):
    np.testing.assert_allclose(np.asarray(synced[k]), theta[k], rtol=1e-6,
                               atol=1e-7)
    for d in range(8):
      np.testing.assert_array_equal(np.asarray(state.params[k])[d],
                                    np.asarray(synced[k]))
    got_error = np.asarray(feedback[i][0]).reshape((8,) + shapes[k])
    np.testing.assert_allclose(got_error, error[k], rtol=1e-5, atol=1e-8)
  # Not a dense exchange: each device holds back most of its mass.
  assert np.mean(error["w"] != 0) > 0.5
