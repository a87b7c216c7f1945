"""Lightning DDP on neuron, 2 devices: tests/integration/test_lightning.py runs it as a script
with the repository on PYTHONPATH, and Lightning's launcher runs it again for rank 1.
argv: accelerator, "eager" or "adaptive", the output file prefix."""
import json
import sys

import torch
import lightning.pytorch as L

import adaptive_eager as ae

from tests.harness.lightning_module import data, module_class


class DDPModule(module_class(L)):
    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        self.losses.append(total.item() / 2)
        self.devices.add(str(self.net[0].weight.device))
        self.batches.append((x.cpu().tolist(), y.cpu().tolist()))
        return loss


accelerator, mode, out = sys.argv[1:4]
ae.set_adaptive(mode == "adaptive")
module = DDPModule()
module.batches = []
trainer = L.Trainer(accelerator=accelerator, devices=2, strategy="ddp", max_steps=3,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(module, data(batch_size=4))
with open(f"{out}.{trainer.global_rank}.json", "w") as f:
    json.dump({"losses": module.losses, "devices": sorted(module.devices),
               "root_device": str(trainer.strategy.root_device),
               "batches": module.batches,
               "params": [p.detach().cpu().tolist() for p in module.parameters()],
               "cpu_fallbacks": ae.metrics().cpu_fallbacks}, f)
