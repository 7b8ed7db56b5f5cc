"""oomkit in the standalone ``pytorch_lightning`` package: one callback for stage memory, phases, OOM capture and ``oomkit run``'s plan.

Example::

    import pytorch_lightning as pl
    from oomkit.integrations.pytorch_lightning import OomkitCallback

    trainer = pl.Trainer(max_epochs=3, callbacks=[OomkitCallback()])
    trainer.fit(model, datamodule=data)   # log: <default_root_dir>/oomkit-logs/run-*.jsonl

Under ``oomkit run`` the callback is added by Lightning's
``pytorch_lightning.callbacks_factory`` entry point with no code at all,
and it sets the micro-batch (the ``batch_size`` attribute of the module, its
hparams or the datamodule, as Lightning's batch-size finder does) and
``trainer.accumulate_grad_batches`` before the data loaders are built.
For ``lightning.pytorch`` use
``oomkit.integrations.lightning``.
"""

from __future__ import annotations

from pytorch_lightning import Callback
from pytorch_lightning.utilities import parsing as _parsing

from oomkit.integrations._lightning import OomkitLightningMixin, factory

__all__ = ["OomkitCallback"]


class OomkitCallback(OomkitLightningMixin, Callback):
    """A ``pytorch_lightning`` ``Callback`` that records oomkit's run log; keyword arguments go to :class:`oomkit.Tracker`."""

    _parsing = _parsing


_callbacks_factory = factory(OomkitCallback)
