"""Collectives: how compressed payloads travel over a mesh axis."""

from jaxcomp.collectives.base import AllGatherMean
from jaxcomp.collectives.base import Collective
from jaxcomp.collectives.base import OwnExchange
from jaxcomp.collectives.base import PsumMean
from jaxcomp.collectives.base import SenderMean
from jaxcomp.collectives.base import default_for
from jaxcomp.collectives.base import get
from jaxcomp.collectives.base import names
from jaxcomp.collectives.base import register
from jaxcomp.collectives.base import chunk_size
from jaxcomp.collectives.hierarchical import Hierarchical
from jaxcomp.collectives.two_phase import Auto
from jaxcomp.collectives.two_phase import TwoPhase
from jaxcomp.collectives.zen import Zen
