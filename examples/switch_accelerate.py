"""A training loop that runs on Hugging Face Accelerate or on triax (only the import differs), saves
its state with `save_state` and resumes with `load_state`: a checkpoint written by one library is
continued by the other (docs/switching.md).

python examples/switch_accelerate.py --library accelerate|triax --steps N [--save DIR] [--resume DIR]
Prints the step, the loss and a digest of the weights at every step.
"""

import argparse
import hashlib

import torch
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--library", choices=["accelerate", "triax"], required=True)
parser.add_argument("--steps", type=int, required=True, help="train until this many steps are done in all")
parser.add_argument("--save", default=None, help="save_state here after the last step")
parser.add_argument("--resume", default=None, help="load_state from here first")
args = parser.parse_args()

if args.library == "triax":
    from triax.accelerate import Accelerator
    from triax.accelerate.utils import set_seed
else:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

accelerator = Accelerator(cpu=True)
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
generator = torch.Generator().manual_seed(1)
# A target the model can learn in a few steps (unit variance), so the printed loss falls as it trains.
features = torch.randn(256, 8, generator=generator)
data = DataLoader(TensorDataset(features, features.sum(1, keepdim=True) / 8 ** 0.5), batch_size=16, shuffle=True)
model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)

done = 0
if args.resume:
    accelerator.load_state(args.resume)
    done = scheduler.scheduler.last_epoch if hasattr(scheduler, "scheduler") else scheduler.last_epoch
    data = accelerator.skip_first_batches(data, done)  # the batches of this epoch already seen
for inputs, targets in data:
    if done >= args.steps:
        break
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    done += 1
    weights = b"".join(p.detach().numpy().tobytes() for p in accelerator.unwrap_model(model).parameters())
    accelerator.print(f"step {done} loss {loss.item():.6f} weights {hashlib.sha256(weights).hexdigest()[:12]}")
if args.save:
    accelerator.save_state(args.save)
