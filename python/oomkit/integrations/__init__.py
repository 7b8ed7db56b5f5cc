"""oomkit inside the trainers people use.

- ``oomkit.integrations.transformers.OomkitCallback``: the Hugging Face ``Trainer``.
- ``oomkit.integrations.lightning.OomkitCallback``: Lightning (``lightning.pytorch``);
  ``oomkit.integrations.pytorch_lightning.OomkitCallback`` for the standalone
  ``pytorch_lightning`` package.
- accelerate loops use ``oomkit.Tracker`` as it is, and
  ``oomkit.auto_batch(..., accelerator=accelerator)``.

Each module imports its framework; ``import oomkit`` imports none of them.
"""
