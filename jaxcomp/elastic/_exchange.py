"""The islands' handshake and exchange over torchft's process group, point
to point: every island sends to every other island of the quorum directly
(gloo ``send``/``recv``, all posted at once), not around gloo's ring.

Why not the ring all-gather: in a ring only the dead island's two
neighbours see its connection close; the others wait on a live neighbour
that has given up, until the group's timeout, and miss the next quorum.
Sent directly, each survivor waits on the dead island itself and fails as
soon as its connection closes. The bytes each island sends are the ring's:
its payload to each of the ``N - 1`` others.

No torch import here: :mod:`jaxcomp.elastic._island` passes torch in.
"""

from __future__ import annotations

import concurrent.futures
from datetime import timedelta

import jax
import numpy as np

from jaxcomp.elastic._common import ElasticConfigError

# sha256 fingerprint (32 bytes), payload length (int64), refused (int64: 1
# when the island's heal was refused, another configuration).
HEADER_BYTES = 48
HANDSHAKE_TAG, PAYLOAD_TAG = 1, 2


def header(fingerprint: str, payload_bytes: int, refused: bool) -> np.ndarray:
  """The handshake's 48 bytes, uint8."""
  out = np.concatenate([
      np.frombuffer(bytes.fromhex(fingerprint), np.uint8),
      np.array([payload_bytes, int(refused)], np.int64).view(np.uint8)])
  assert out.size == HEADER_BYTES, out.size
  return out


def exchange_ranks(headers: list[np.ndarray], fingerprint: str,
                   payload_bytes: int, island: str) -> list[int]:
  """From the quorum's headers (in rank order): the ranks of the exchange
  (those not refused).

  Raises:
    ElasticConfigError: a rank not refused has another fingerprint (model
      or configuration), or a payload not ``payload_bytes`` long (another
      share: the island's processes hold the parameters otherwise).
  """
  refused = [bool(h[40:].view(np.int64)[0]) for h in headers]
  ranks = [i for i in range(len(headers)) if not refused[i]]
  bad = [i for i in ranks if headers[i][:32].tobytes().hex() != fingerprint]
  if bad:
    raise ElasticConfigError(
        f"island {island!r}: the peers of rank(s) {bad} in this quorum have "
        "another model or configuration (their fingerprint differs); every "
        "island must start with the same parameters, compressor and config")
  sizes = [i for i in ranks if int(headers[i][32:40].view(np.int64)[0]) != payload_bytes]
  if sizes:
    raise ElasticConfigError(
        f"island {island!r}: the peers of rank(s) {sizes} in this quorum send "
        "shares of another size: every island must hold its parameters alike "
        "(the same processes and shardings)")
  return ranks


def swap(torch, pg, buf: np.ndarray, me: int, ranks: list[int], tag: int,
         timeout: timedelta) -> list[np.ndarray]:
  """Sends ``buf`` (uint8) to every rank of ``ranks`` but ``me`` and
  receives theirs (as long as ``buf``), all posted at once; returns them in
  ``ranks``' order (``buf`` itself at ``me``).

  Raises:
    RuntimeError: what gloo raises: a peer's connection closed, no data
      within ``timeout``.
  """
  t = torch.from_numpy(buf)
  got = {r: torch.empty_like(t) for r in ranks if r != me}
  works = [w for r, out in got.items()
           for w in (pg.send([t], r, tag), pg.recv([out], r, tag))]
  for w in works:
    w.wait(timeout)
  return [buf if r == me else got[r].numpy() for r in ranks]


class Decoders:
  """The islands' decode-and-mean (``_outer.decode_mean``, jitted) compiled
  per island count, each ahead of its first sync in a thread of its own:
  a quorum of a new size (an island lost or joined) then costs the sync no
  compile, which runs beside the interval's inner steps instead.

  Args:
    decode_mean: the jitted ``(payloads, key) -> mean``.
    payload: the payload arrays of one island (``BufferPlan.payload``).
    key: a key like the sync's (its shape and dtype).
  """

  def __init__(self, decode_mean, payload, key):
    self._fn, self._payload, self._key = decode_mean, payload, key
    self._pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="jaxcomp_decode")
    self._compiled: dict[int, concurrent.futures.Future] = {}

  def warm(self, islands: int) -> None:
    """Starts compiling for ``islands`` payloads, unless done or under
    way."""
    if islands < 1 or islands in self._compiled:
      return
    shapes = [jax.ShapeDtypeStruct((islands, *s.shape), s.dtype)
              for s in self._payload]
    self._compiled[islands] = self._pool.submit(
        lambda: self._fn.lower(shapes, self._key).compile())

  def __call__(self, stacked, key):
    """The mean of ``stacked`` (per payload array, the islands' arrays
    stacked in rank order): float32 ``(n,)``."""
    islands = int(stacked[0].shape[0])
    self.warm(islands)
    return self._compiled[islands].result()(stacked, key)
