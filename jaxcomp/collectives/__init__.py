"""Collectives: how compressed payloads travel over a mesh axis."""

from jaxcomp.collectives.base import AllGatherMean
from jaxcomp.collectives.base import Collective
from jaxcomp.collectives.base import OwnExchange
from jaxcomp.collectives.base import PsumMean
from jaxcomp.collectives.base import decode_sum
from jaxcomp.collectives.base import default_for
from jaxcomp.collectives.base import get
from jaxcomp.collectives.base import names
from jaxcomp.collectives.base import register
