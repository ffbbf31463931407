"""``python -m lightning_scale.checkpoint inspect|consolidate|export-hf ...`` (see :mod:`.cli`)."""

import sys

from lightning_scale.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main())
