"""Checkpoints of the whole train state, compression state included.

:class:`Checkpointer` saves and restores parameters and optimizer state with
Orbax in single- and multi-process jobs (per-device residuals, PowerSGD Q,
keys, counts), with metadata describing the compression configuration and
the topology (:func:`describe`), checked on restore (:func:`validate`)
before any array is read.
"""

from jaxcomp.checkpoint._checkpointer import Checkpointer
from jaxcomp.checkpoint._integrity import CheckpointDamagedError
from jaxcomp.checkpoint._metadata import CHECKPOINT_FORMAT
from jaxcomp.checkpoint._metadata import READABLE_FORMATS
from jaxcomp.checkpoint._metadata import CheckpointMismatchError
from jaxcomp.checkpoint._metadata import compression_config
from jaxcomp.checkpoint._metadata import describe
from jaxcomp.checkpoint._metadata import validate
from jaxcomp.checkpoint._topology import topology_rules

__all__ = [
    "CHECKPOINT_FORMAT",
    "READABLE_FORMATS",
    "CheckpointMismatchError",
    "CheckpointDamagedError",
    "compression_config",
    "topology_rules",
    "describe",
    "validate",
    "Checkpointer",
]
