"""The LightningModule tests/integration/test_lightning.py trains (a module, so that Lightning's
DDP launcher can run tests/harness/lightning_ddp.py as a script)."""
import torch


def module_class(L):
    """A small MLP for Lightning package `L` (lightning.pytorch or pytorch_lightning): records
    each step's loss, and the devices and dtypes it saw."""

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                           torch.nn.Linear(16, 4))
            self.losses, self.devices, self.dtypes = [], set(), set()

        def training_step(self, batch, i):
            x, y = batch
            out = self.net(x)
            self.dtypes.add(out.dtype)
            self.devices.add(str(self.net[0].weight.device))
            loss = torch.nn.functional.mse_loss(out.float(), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Module


def data(batch_size=4, n=24):
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g),
                                        torch.randn(n, 4, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=batch_size)
