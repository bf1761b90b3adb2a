"""Encode and decode costs of the compressors on a GPU, from measured
kernel rows, for ``jaxcomp whatif --device <gpu>`` (no GPU needed to ask).

The rows below were measured on one NVIDIA H200 on 2026-11-28 (JAX
0.11.2, float32 buffers, median per call of 7 trials, calls back to back,
inputs over 4x the L2) and are copied from the repository's
``benchmarks/results/nvidia-h200-2026-11-28/`` (``kernels.txt``: the 1e6
rows; ``quant_triton.txt``: the copy and the int8 and fp8 blocks' XLA
path; ``quant_block_rows.txt``: sign and QSGD, XLA reference;
``topk_2p5e7*.json`` and ``topk_1e8.json``: top-k's XLA fast path,
``selection="sort"``, median of three runs at 2.5e7), as
``docs/kernels.md`` reports them. They are a copy so that the installed
package answers without the checkout.

How each cost is made (:func:`gpu_codec`):

* encode of a compressor with rows: a least-squares line ``a + b·n``
  through its rows (measured), times ``4800 / HBM GB/s`` of the target
  device (derived: the passes are bandwidth-bound);
* encode of one without rows: one read of the float32 buffer and one write
  of its payload at the copy's rate (derived); PowerSGD's, four passes
  over the buffer (``M Q`` and ``M^T P`` read it, the residual
  ``M - P Q^T`` is read and written: memory-bound at small ranks);
* decode, every compressor: one read of the payload and one write of the
  float32 buffer at the copy's rate (derived: no decode was timed).
"""

from __future__ import annotations

from jaxcomp.perfmodel import codec as _codec
from jaxcomp.perfmodel import hardware
from jaxcomp.perfmodel import pricing as _pricing

__all__ = ["TABLE_DEVICE", "TABLE_SOURCE", "ROWS", "gpu_codec"]

TABLE_DEVICE = "h200"
TABLE_SOURCE = "benchmarks/results/nvidia-h200-2026-11-28 (NVIDIA H200, JAX 0.11.2, 2026-11-28)"

# op: ((elements, seconds per call), ...), float32, the XLA paths
# implementation=None runs (the faster Triton int8/fp8 kernels are not
# counted: an upper bound on their cost).
ROWS: dict[str, tuple[tuple[int, float], ...]] = {
    "copy": ((1_000_000, 0.012e-3), (25_000_000, 0.062e-3), (100_000_000, 0.220e-3)),
    "int8_block": ((25_000_000, 0.097e-3), (100_000_000, 0.253e-3)),
    "fp8_block": ((25_000_000, 0.100e-3), (100_000_000, 0.251e-3)),
    "sign": ((1_000_000, 0.034e-3), (25_000_000, 0.098e-3), (100_000_000, 0.265e-3)),
    "qsgd": ((25_000_000, 0.131e-3),),
    "topk": ((1_000_000, 0.167e-3), (25_000_000, 0.555e-3), (100_000_000, 0.857e-3)),
}
# Which row times each compressor's encode (by Compressor.name).
_ENCODE_ROW = {"int8_block": "int8_block", "fp8_block": "fp8_block", "sign": "sign",
               "onebit": "sign", "qsgd": "qsgd", "topk": "topk"}
_N = 100_000_000  # the size a payload's bytes per element are read at


def _line(op: str) -> tuple[float, float]:
  ns, ts = zip(*ROWS[op])
  return _codec._fit_affine(ns, ts)


def _payload_per_element(compressor) -> float:
  nbytes = getattr(compressor, "payload_bytes", None)
  return (nbytes(_N) / _N) if nbytes is not None else 4.0


def gpu_codec(compressor, device: hardware.DevicePreset) -> tuple[_pricing.CodecCost, str]:
  """The encode/decode cost of ``compressor`` on ``device`` and how it was made.

  Args:
    compressor: a ``jaxcomp.compressors`` compressor or a
      :class:`PricedCompressor` (``payload_bytes``).
    device: a GPU preset (:data:`jaxcomp.perfmodel.hardware.DEVICES`).

  Returns:
    ``(CodecCost, label)``; the label says which numbers are measured and
    which derived, and the scale factor.

  Raises:
    ValueError: ``device`` is not a GPU.
  """
  if not device.gpu:
    raise ValueError(f"the kernel tables are for GPUs, not {device.name!r}")
  scale = hardware.DEVICES[TABLE_DEVICE].hbm_gbytes_per_s / device.hbm_gbytes_per_s
  copy_a, copy_b = _line("copy")  # seconds, seconds per element (8 bytes moved)
  per_byte = copy_b / 8.0
  payload = _payload_per_element(compressor)
  row = _ENCODE_ROW.get(getattr(compressor, "name", ""))
  if row is not None:
    enc_a, enc_b = _line(row)
    how = f"encode measured (H200 '{row}' rows)"
  elif getattr(compressor, "name", "") == "powersgd":
    enc_a, enc_b = copy_a, (16.0 + payload) * per_byte
    how = ("encode derived (no kernel row: four passes over the buffer, M Q, M^T P and "
           "the residual)")
  else:
    enc_a, enc_b = copy_a, (4.0 + payload) * per_byte
    how = "encode derived (no kernel row: one read of the buffer, one write of the payload)"
  dec_b = (payload + 4.0) * per_byte
  cost = _pricing.CodecCost(enc_a * scale, enc_b * scale, copy_a * scale, dec_b * scale,
                            device=f"{device.name} (from {TABLE_DEVICE} rows)")
  where = ("" if device.name == TABLE_DEVICE else
           f", x{scale:.2f} for {device.name}'s HBM ({device.hbm_gbytes_per_s:g} GB/s)")
  return cost, f"{how}; decode derived from the copy row{where}"
