"""TernGrad: stochastic ternarization with a scale shared over the axis."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp import _parts
from jaxcomp import wire
from jaxcomp._mesh import axis_size
from jaxcomp.compressors import _hparams
from jaxcomp.compressors.base import Compressor, register
from jaxcomp.kernels import bitpack
from jaxcomp.kernels import dither

_BITS = 2  # code 0: 0, code 1: +1, code 2: -1


@register
@dataclasses.dataclass(frozen=True)
class TernGrad(Compressor):
  """TernGrad (Wen et al. 2017): ``s * sign(x) * b`` with ``b ~ Bernoulli(|x| / s)``.

  The scale ``s`` is the maximum of ``|x|`` over the bucket *and over all
  devices* (one scalar ``lax.pmax``, the paper's scaler sharing), so every
  device ternarizes against the same ``s``: the decoded mean
  ``s * sum_i t_i / p`` equals the mean of the decoded per-device values
  ``s * t_i`` exactly, and ``E[s * t_i] = x_i`` (unbiased; the rounding
  draws are independent per device). Variance per element:
  ``s * |x| - x^2 <= s^2 / 4``.

  Optional gradient clipping (the paper's ``c * sigma``): with
  ``clip_sigma=c`` each device first clips ``x`` to ``[-c std(x), c std(x)]``
  (this makes the compressor biased; off by default).

  Payload: the ternary codes packed 2 bits per element, uint32
  ``(ceil(n / 16),)``, all-gathered; plus the float32 scale in the ``pmax``
  all-reduce: ``4 * ceil(n / 16) + 4`` bytes.

  Args:
    clip_sigma: clip at ``clip_sigma`` standard deviations first (> 0), or
      None (no clipping).

  Raises:
    ValueError: ``clip_sigma`` <= 0.

  References:
    Wen et al., TernGrad: Ternary Gradients to Reduce Communication in
    Distributed Deep Learning <https://arxiv.org/abs/1705.07878>, 2017.
  """

  name: ClassVar[str] = "terngrad"
  randomness: ClassVar[str] = "independent"
  own_exchange: ClassVar[bool] = True
  clip_sigma: float | None = None

  def __post_init__(self):
    if self.clip_sigma is not None:
      _hparams.check_number(self.clip_sigma, "clip_sigma", low=0.0,
                            low_open=True)

  def _clip(self, x):
    if self.clip_sigma is None:
      return x
    c = _hparams.as_f32(self.clip_sigma) * jnp.std(x)
    return jnp.clip(x, -c, c)

  def ternarize(self, x: jax.Array, scale: jax.Array,
                key: jax.Array) -> jax.Array:
    """int8 ``(n,)`` in {-1, 0, 1} against the (shared) float32 ``scale``."""
    safe = jnp.where(scale > 0, scale, 1.0)
    u = dither.uniform(key, x.shape[0])
    keep = u < jnp.abs(x) / safe
    return jnp.where(keep, jnp.sign(x), 0.0).astype(jnp.int8)

  def pack(self, t: jax.Array) -> jax.Array:
    """Packs ternary values to 2-bit codes (0, 1 = +1, 2 = -1)."""
    codes = jnp.where(t < 0, 2, t).astype(jnp.uint32)
    return bitpack.pack_bits_reference(codes, _BITS)

  def unpack(self, words: jax.Array, n: int) -> jax.Array:
    """float32 ``(n,)`` in {-1, 0, 1} from packed codes."""
    c = bitpack.unpack_bits_reference(words, _BITS, n)
    return (c == 1).astype(jnp.float32) - (c == 2).astype(jnp.float32)

  def encode(self, x, key):
    """Single-device encode (scale = this device's max): codes and scale."""
    x = self._clip(x.astype(jnp.float32))
    scale = jnp.max(jnp.abs(x))
    return {"codes": self.pack(self.ternarize(x, scale, key)), "scale": scale}

  def decode(self, payload, n, key):
    del key
    return payload["scale"] * self.unpack(payload["codes"], n)

  def exchange(self, parts, shapes, *, key, step, axis_name, state):
    del step
    x = self._clip(_parts.concat(parts).astype(jnp.float32))
    n = x.shape[0]
    scale = lax.pmax(jnp.max(jnp.abs(x)), axis_name)
    words = self.pack(self.ternarize(x, scale, key))
    gathered = lax.all_gather(words, axis_name, to="invarying")
    # The decodes at scale 1 are integer counts, summed exactly; one
    # multiplication by the shared scale then rounds once.
    p = gathered.shape[0]
    counts = self.decode_sum({"codes": gathered,
                              "scale": jnp.ones((p,), jnp.float32)}, n, key)
    mean = scale * counts / jnp.float32(axis_size(axis_name))
    sizes = _parts.sizes(shapes)
    return (_parts.split(mean, sizes),
            _parts.split(scale * self.unpack(words, n), sizes), state)

  def transfers(self, shapes, sizes, dtype=jnp.float32):
    """A float32 scalar all-reduce (the ``pmax`` of the scale), then an
    all-gather of the packed codes (whatever the gradient's dtype)."""
    del dtype
    n = sum(_parts.sizes(shapes))
    axis = wire.axes_of(sizes)
    return (wire.transfers("all-reduce", (4,), axis, sizes)
            + wire.transfers("all-gather",
                             (4 * bitpack.packed_words(n, _BITS),), axis,
                             sizes))

  def payload_bytes(self, n: int) -> int:
    return 4 * bitpack.packed_words(n, _BITS) + 4
