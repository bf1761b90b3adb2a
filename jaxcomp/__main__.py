"""``python -m jaxcomp ...``: the ``jaxcomp`` command line, for environments
whose console scripts are not on ``PATH``."""

import sys

from jaxcomp import cli

if __name__ == "__main__":
  sys.exit(cli.main())
