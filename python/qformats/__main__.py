"""``python -m qformats``: the ``qformats`` command (:func:`qformats.cli.main`). This is what
``torchrun --nproc-per-node N -m qformats quantize MODEL --stream ...`` runs on each rank.
Imported as a module (tools that import every submodule), it runs nothing."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
