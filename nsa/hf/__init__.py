"""The Hugging Face format of a trained model: ``nsa export --format hf`` and reading it back.

- :mod:`nsa.hf.format`: the folder's files, ``config.json`` from a run config and back, the weight names.
- :mod:`nsa.hf.tokenizer`: the run's tokenizer as ``tokenizer.json`` / ``tokenizer_config.json``.
- :mod:`nsa.hf.export`: :func:`export_hf` (writes the folder), :func:`is_hf_folder`, :func:`read_hf` and
  :func:`read_init_weights` (``train.init_from`` of such a folder).
- ``modeling_nsa.py``: the modelling code copied into every export (``trust_remote_code``); self-contained
  (torch and transformers; the ``nsa`` package when importable). The library never imports it.

Layer: above the model (it reads weights with :mod:`nsa.model.load`), below the trainer (which exports at the
end of a run when ``checkpoint.export_hf`` is set) and the CLI; the model never imports it.
"""

from __future__ import annotations

from nsa.hf.export import HFExport, export_hf, is_hf_folder, read_hf, read_init_weights
from nsa.hf.format import FORMAT_VERSION

__all__ = ["FORMAT_VERSION", "HFExport", "export_hf", "is_hf_folder", "read_hf", "read_init_weights"]
