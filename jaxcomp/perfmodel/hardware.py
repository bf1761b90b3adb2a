"""Device and network presets of ``jaxcomp whatif``: what a GPU computes and
moves per second, and what a link carries, from the vendors' datasheets.

Every figure here is a datasheet's number (peak dense throughput, no
sparsity) or, where it says so, an assumption. A device's peak is not what
a training step reaches: :mod:`jaxcomp.perfmodel.decoders` multiplies it
by a model FLOP utilization (MFU) that the user sets.

References:
  NVIDIA Tesla V100 datasheet (SXM2 32 GB)
  <https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf>;
  NVIDIA A100 datasheet (SXM4 80 GB)
  <https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf>;
  NVIDIA H100 datasheet (SXM5 80 GB)
  <https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet>;
  NVIDIA H200 product page and datasheet (SXM 141 GB)
  <https://www.nvidia.com/en-us/data-center/h200/>;
  IEEE 802.3ae (10 GbE), 802.3by (25 GbE), 802.3ba (100 GbE);
  NVIDIA ConnectX-6 (HDR 200 Gbit/s) and ConnectX-7 (NDR 400 Gbit/s)
  InfiniBand adapter datasheets.
"""

from __future__ import annotations

import dataclasses

import jax

__all__ = ["DevicePreset", "NetworkPreset", "DEVICES", "NETWORKS", "device_preset",
           "network_preset", "device_at_hand"]


@dataclasses.dataclass(frozen=True)
class DevicePreset:
  """One accelerator as the model prices it.

  Attributes:
    name: the preset's key (``"h100"``).
    description: the part the numbers are for.
    peak_bf16_tflops: peak dense bfloat16 tensor-core TFLOP/s (V100: float16,
      it has no bfloat16).
    peak_fp32_tflops: peak dense float32 TFLOP/s (no TF32).
    hbm_gbytes_per_s: memory bandwidth, GB/s (10^9 bytes).
    memory_gbytes: memory, GB.
    intra_gbps: the link between devices of one node, Gbit/s per direction
      (NVLink's total bidirectional bandwidth / 2).
    gpu: whether it is a GPU (its codec costs come from the kernel tables).
    source: where the numbers come from.
    assumed: True when the numbers are assumptions, not a datasheet's.
  """

  name: str
  description: str
  peak_bf16_tflops: float
  peak_fp32_tflops: float
  hbm_gbytes_per_s: float
  memory_gbytes: float
  intra_gbps: float
  gpu: bool
  source: str
  assumed: bool = False

  @property
  def label(self) -> str:
    """``"assumed"`` or ``"datasheet"``, and the source."""
    return f"{'assumed' if self.assumed else 'datasheet'}: {self.source}"


@dataclasses.dataclass(frozen=True)
class NetworkPreset:
  """One inter-node link: bandwidth per worker and start-up cost per message.

  Attributes:
    name: the preset's key (``"25gbe"``).
    description: what it is.
    gbps: line rate, Gbit/s (the standard's).
    latency_us: start-up cost per message (alpha), microseconds: an
      assumption for the transport named in ``description``.
    source: the standard or datasheet of the line rate.
  """

  name: str
  description: str
  gbps: float
  latency_us: float
  source: str


_NV = "NVIDIA {} datasheet"
DEVICES: dict[str, DevicePreset] = {d.name: d for d in (
    DevicePreset("v100", "NVIDIA V100 SXM2 32 GB", 125.0, 15.7, 900.0, 32.0, 1200.0, True,
                 _NV.format("Tesla V100") + " (float16 tensor cores: no bfloat16; "
                 "NVLink 300 GB/s both ways)"),
    DevicePreset("a100", "NVIDIA A100 SXM4 80 GB", 312.0, 19.5, 2039.0, 80.0, 2400.0, True,
                 _NV.format("A100") + " (NVLink 600 GB/s both ways)"),
    DevicePreset("h100", "NVIDIA H100 SXM5 80 GB", 989.0, 67.0, 3350.0, 80.0, 3600.0, True,
                 _NV.format("H100") + " (1979 TFLOP/s bf16 with sparsity, 989 dense; "
                 "NVLink 900 GB/s both ways)"),
    DevicePreset("h200", "NVIDIA H200 SXM 141 GB", 989.0, 67.0, 4800.0, 141.0, 3600.0, True,
                 _NV.format("H200") + " (989 TFLOP/s bf16 dense; NVLink 900 GB/s both ways)"),
    DevicePreset("cpu", "a 32-core x86 server socket, AVX-512 at 2 GHz, 8 channels of DDR5-4800",
                 4.1, 4.1, 307.0, 512.0, 1200.0, False,
                 "32 cores x 2 FMA units x 16 float32 lanes x 2 FLOP x 2 GHz; 8 x 38.4 GB/s",
                 assumed=True),
)}

NETWORKS: dict[str, NetworkPreset] = {n.name: n for n in (
    NetworkPreset("10gbe", "10 Gigabit Ethernet, TCP sockets", 10.0, 50.0, "IEEE 802.3ae"),
    NetworkPreset("25gbe", "25 Gigabit Ethernet, TCP sockets", 25.0, 50.0, "IEEE 802.3by"),
    NetworkPreset("100gbe", "100 Gigabit Ethernet, RoCE v2", 100.0, 10.0, "IEEE 802.3ba"),
    NetworkPreset("ib-hdr", "InfiniBand HDR 200 Gbit/s, one adapter per GPU", 200.0, 5.0,
                  "NVIDIA ConnectX-6 datasheet"),
    NetworkPreset("ib-ndr", "InfiniBand NDR 400 Gbit/s, one adapter per GPU", 400.0, 5.0,
                  "NVIDIA ConnectX-7 datasheet"),
    NetworkPreset("wan-1g", "1 Gbit/s between sites, ~1000 km of fibre (5 us/km one way)",
                  1.0, 5000.0, "a leased 1 Gbit/s line"),
)}


def _preset(table: dict, what: str, name: str):
  key = name.lower()
  if key not in table:
    raise ValueError(f"unknown {what} {name!r}; presets are {', '.join(table)}")
  return table[key]


def device_preset(name: str) -> DevicePreset:
  """The preset ``name`` (case-insensitive).

  Raises:
    ValueError: no such preset; the message lists them.
  """
  return _preset(DEVICES, "device", name)


def network_preset(name: str) -> NetworkPreset:
  """The preset ``name`` (case-insensitive).

  Raises:
    ValueError: no such preset; the message lists them.
  """
  return _preset(NETWORKS, "network", name)


def preset_of_kind(platform: str, device_kind: str) -> DevicePreset | None:
  """The preset a JAX device (``platform``, ``device_kind``) is, if any.

  ``"gpu", "NVIDIA H100 80GB HBM3"`` is ``h100``; any ``"cpu"`` is ``cpu``;
  other devices are ``None``.
  """
  if platform == "cpu":
    return DEVICES["cpu"]
  kind = device_kind.upper()
  for name in ("v100", "a100", "h100", "h200"):
    if name.upper() in kind:
      return DEVICES[name]
  return None


def device_at_hand() -> tuple[DevicePreset | None, str]:
  """The preset of JAX's default device and its ``platform:device_kind``."""
  dev = jax.devices()[0]
  return preset_of_kind(dev.platform, dev.device_kind), f"{dev.platform}:{dev.device_kind}"
