"""A training script written the way Accelerate's examples and transformers' `*_no_trainer` scripts
are (get_logger, set_seed, a shuffled DataLoader, dropout, gradient accumulation, a scheduler,
checkpointing every n steps or every epoch, --resume_from_checkpoint with skip_first_batches,
evaluation with gather_for_metrics), runnable on either library:

python train_like_examples.py --library triax|accelerate --output_dir DIR [--checkpointing_steps N|epoch]
                              [--resume_from_checkpoint DIR/step_N] [--gradient_accumulation_steps K]
                              [--use_seedable_sampler] [--dataloader_generator] [--automatic_naming LIMIT]
Writes DIR/result_<rank>.json (losses, evaluation, random draws) and DIR/weights.safetensors.
test_accelerate_same_numbers.py runs it on both libraries and compares the results bitwise.
"""

import argparse
import json
import os

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--library", choices=["triax", "accelerate"], required=True)
parser.add_argument("--output_dir", required=True)
parser.add_argument("--checkpointing_steps", default=None, help="a number of steps, or 'epoch'")
parser.add_argument("--resume_from_checkpoint", default=None)
parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
parser.add_argument("--num_epochs", type=int, default=3)
parser.add_argument("--per_device_batch_size", type=int, default=4)
parser.add_argument("--use_seedable_sampler", action="store_true")
parser.add_argument("--dataloader_generator", action="store_true", help="give the DataLoader a generator")
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--automatic_naming", type=int, default=None,
                    help="at the end, save 3 more times with automatic_checkpoint_naming and this total_limit")
args = parser.parse_args()

if args.library == "triax":
    from triax.accelerate import Accelerator, DataLoaderConfiguration
    from triax.accelerate.logging import get_logger
    from triax.accelerate.utils import set_seed
else:
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.logging import get_logger
    from accelerate.utils import set_seed

logger = get_logger(__name__)


class Regression(Dataset):
    """y = a.x + b + noise, from a fixed generator (the data never depends on the seed under test)."""

    def __init__(self, size, offset=0):
        generator = torch.Generator().manual_seed(1234 + offset)
        self.x = torch.randn(size, 8, generator=generator)
        self.y = self.x @ torch.arange(1.0, 9.0) / 8 + 0.1 * torch.randn(size, generator=generator)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return {"x": self.x[index], "y": self.y[index], "index": index}


def main():
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=args.use_seedable_sampler))
    logger.info(f"{accelerator.num_processes} processes", main_process_only=True)
    set_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(args.seed) if args.dataloader_generator else None
    train_dataloader = DataLoader(Regression(60), shuffle=True, batch_size=args.per_device_batch_size,
                                  generator=generator)
    eval_dataloader = DataLoader(Regression(21, offset=1), batch_size=args.per_device_batch_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.1 * step))
    model, optimizer, train_dataloader, eval_dataloader, scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, scheduler)

    checkpointing_steps = args.checkpointing_steps
    if checkpointing_steps is not None and checkpointing_steps.isdigit():
        checkpointing_steps = int(checkpointing_steps)
    overall_step, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        name = os.path.basename(args.resume_from_checkpoint.rstrip("/"))
        if name.startswith("epoch_"):
            starting_epoch = int(name.removeprefix("epoch_")) + 1
            overall_step = starting_epoch * len(train_dataloader)
        else:
            resume_step = int(name.removeprefix("step_"))
            starting_epoch = resume_step // len(train_dataloader)
            overall_step = resume_step
            resume_step -= starting_epoch * len(train_dataloader)

    losses, evaluations, draws = [], [], []
    for epoch in range(starting_epoch, args.num_epochs):
        model.train()
        if args.use_seedable_sampler:
            train_dataloader.set_epoch(epoch)
        if resume_step is not None and epoch == starting_epoch:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                prediction = model(batch["x"]).squeeze(-1)
                loss = torch.nn.functional.mse_loss(prediction, batch["y"])
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            overall_step += 1
            if isinstance(checkpointing_steps, int) and overall_step % checkpointing_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{overall_step}"))

        model.eval()
        gathered = []
        for batch in eval_dataloader:
            with torch.no_grad():
                prediction = model(batch["x"]).squeeze(-1)
            prediction, index = accelerator.gather_for_metrics((prediction, batch["index"]))
            gathered += [[int(i), p] for i, p in zip(index.tolist(), prediction.tolist())]
        evaluations.append(gathered)
        draws.append(torch.rand(()).item())  # the state torch's generator is left in, as a number
        logger.info(f"epoch {epoch}: {len(gathered)} evaluated")
        if checkpointing_steps == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))

    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, f"result_{accelerator.process_index}.json"), "w") as handle:
        json.dump({"losses": losses, "evaluations": evaluations, "draws": draws,
                   "lr": scheduler.get_last_lr()}, handle)
    accelerator.wait_for_everyone()
    state = accelerator.unwrap_model(model).state_dict()
    if accelerator.is_main_process:
        save_file({name: tensor.contiguous() for name, tensor in state.items()},
                  os.path.join(args.output_dir, "weights.safetensors"))
    if args.automatic_naming is not None:
        project = accelerator.project_configuration
        project.project_dir = os.path.join(args.output_dir, "project")
        project.automatic_checkpoint_naming, project.total_limit = True, args.automatic_naming
        for _ in range(3):
            accelerator.save_state("ignored: automatic naming decides")
    # No end_training(): on Accelerate it destroys the gloo process group right after the last
    # all-reduce, which can hang with torch 2.13 (docs/accelerate.md); the job ends here anyway.


if __name__ == "__main__":
    main()
