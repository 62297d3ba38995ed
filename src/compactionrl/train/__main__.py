"""``python -m compactionrl.train [--config FILE] [overrides]`` — the ``train`` command, for ``torchrun -m``."""

import sys

from compactionrl.cli import app

if __name__ == "__main__":
    app(["train", *sys.argv[1:]], prog_name="compactionrl")
