"""The run-directory format, below the trainer, the model loader and the run readers: file names and
paths (:mod:`nsa.rundir.layout`, :class:`RunDir`) and the checkpoint container
(:mod:`nsa.rundir.checkpoints`). Torch-free; imports nothing of ``nsa`` but ``nsa.errors``."""

from nsa.rundir.layout import RunDir

__all__ = ["RunDir"]
