"""``python -m hpoflow.engines.agent``: a node agent (see ``hpoflow.engines.agent.agent``)."""

from __future__ import annotations

import sys

from hpoflow.engines.agent.agent import main

if __name__ == "__main__":
    sys.exit(main())
