"""A training loop written like seed 003's example, on synthetic data, for the Accelerator tests.

python loop.py --out DIR [--batch-size 8] [--accumulate 1] [--epochs 2] [--dropout 0] [--scheduler-steps per_update]
               [--save-at N --save DIR] [--resume DIR] [--eval]
Writes DIR/rank_<r>.json (counters, gathered eval ids) and DIR/weights.safetensors (main process).
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset

from triax import Accelerator
from triax.accelerate import DataLoaderConfiguration


class Progress:
    """Batches done, saved with the Accelerator's state (register_for_checkpointing)."""

    def __init__(self):
        self.batches_done = 0

    def state_dict(self):
        return {"batches_done": self.batches_done}

    def load_state_dict(self, state):
        self.batches_done = state["batches_done"]


class Synthetic(Dataset):
    """Inputs and class labels from a fixed generator, plus each sample's id."""

    def __init__(self, size: int, features: int = 12, classes: int = 5):
        generator = torch.Generator().manual_seed(1234)
        self.inputs = torch.randn(size, features, generator=generator)
        self.labels = torch.randint(0, classes, (size,), generator=generator)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return {"inputs": self.inputs[index], "labels": self.labels[index], "ids": index}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--eval-samples", type=int, default=23)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--eval-batch-size", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--save-at", type=int, default=0, help="save_state after this many batches (and go on)")
    parser.add_argument("--save", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--eval", action="store_true")
    parser.add_argument("--parallel", default=None)
    parser.add_argument("--scheduler-steps", default="per_process",
                        help="per_update: the scheduler steps once per update, so N processes x batch b "
                             "equal one process x batch N*b")
    parser.add_argument("--init-group", action="store_true",
                        help="create the process group before the Accelerator, as some scripts do")
    args = parser.parse_args()

    if args.init_group:
        torch.distributed.init_process_group("gloo")
    # The seedable sampler draws epoch e's order from (seed + e) with the DataLoader's own generator,
    # never from torch's global one: 1 process and N draw the same order, and a resumed run, whose
    # global generator load_state restores, sees the same dropout masks as the uninterrupted one.
    accelerator = Accelerator(gradient_accumulation_steps=args.accumulate, parallel=args.parallel,
                              scheduler_steps=args.scheduler_steps,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Dropout(args.dropout),
                                torch.nn.Linear(32, 5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    data = DataLoader(Synthetic(args.samples), batch_size=args.batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(0))
    eval_data = DataLoader(Synthetic(args.eval_samples), batch_size=args.eval_batch_size)
    model, optimizer, data, scheduler, eval_data = accelerator.prepare(model, optimizer, data, scheduler, eval_data)

    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume:
        accelerator.load_state(args.resume)
    # Accelerate's way to resume: the epoch from the count of batches done, then skip_first_batches.
    first_epoch, skip = divmod(progress.batches_done, len(data))
    losses = []
    model.train()
    for epoch in range(first_epoch, args.epochs):
        data.set_epoch(epoch)
        for batch in accelerator.skip_first_batches(data, skip) if epoch == first_epoch and skip else data:
            with accelerator.accumulate(model):
                output = model(batch["inputs"])
                loss = F.cross_entropy(output, batch["labels"])
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            progress.batches_done += 1
            if args.save_at and progress.batches_done == args.save_at:
                accelerator.save_state(args.save)

    gathered_ids = []
    if args.eval:
        model.eval()
        for batch in eval_data:
            with torch.no_grad():
                predictions = model(batch["inputs"]).argmax(-1)
            ids, predictions = accelerator.gather_for_metrics((batch["ids"], predictions))
            gathered_ids += ids.tolist()

    os.makedirs(args.out, exist_ok=True)
    record = {"losses": losses, "optimizer_steps": optimizer.num_steps,
              "scheduler_steps": scheduler.last_epoch, "gathered_ids": gathered_ids,
              "num_processes": accelerator.num_processes, "process_index": accelerator.process_index,
              "batches_per_epoch": len(data)}
    with open(os.path.join(args.out, f"rank_{accelerator.process_index}.json"), "w") as handle:
        json.dump(record, handle)
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        save_file({name: tensor.contiguous() for name, tensor in state.items()},
                  os.path.join(args.out, "weights.safetensors"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
