"""An Accelerator with a model, an optimizer, a scheduler, a loader and a registered object prepared,
ready to save_state: the folders of test_accelerate_folder.py and the hostile-input tests."""

import torch
from torch.utils.data import DataLoader

from triax.accelerate import Accelerator


class Counter:
    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def prepared(model=None, stateful=False):
    from triax.accelerate import DataLoaderConfiguration

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
    model = model or torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    loader = DataLoader(list(range(8)), batch_size=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    return accelerator, model, optimizer, scheduler, counter, loader
