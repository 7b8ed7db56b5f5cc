"""oomkit's callback in a Lightning run: the example of docs/tracker.md, on CPU in a few seconds.

    python examples/lightning_quickstart.py
    oomkit analyze runs/pl/oomkit-logs/run-*.jsonl

`examples/lightning_trainer.py` is the same run with flags: gradient
accumulation, a planted OOM, DDP, either Lightning namespace.
"""

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from oomkit.integrations.lightning import OomkitCallback   # pytorch_lightning: oomkit.integrations.pytorch_lightning


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Data(L.LightningDataModule):
    def __init__(self, batch_size=8):
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(96, 32, generator=g), torch.randn(96, generator=g)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[:16], self.y[:16]), batch_size=8)


torch.manual_seed(0)
model, data = Regressor(), Data()
trainer = L.Trainer(max_steps=6, default_root_dir="runs/pl", callbacks=[OomkitCallback()])
trainer.fit(model, datamodule=data)    # log: runs/pl/oomkit-logs/run-*.jsonl
