"""``python -m qformats``: the ``qformats`` command (:func:`qformats.cli.main`). This is what
``torchrun --nproc-per-node N -m qformats quantize MODEL --stream ...`` runs on each rank."""
import sys

from .cli import main

sys.exit(main())
