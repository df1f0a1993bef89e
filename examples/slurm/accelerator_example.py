"""A triax.Accelerator loop whose result does not depend on how many processes run it: 64 fixed
samples, a global batch of 8 split across the processes, float64. Started by srun directly
(`srun python accelerator_example.py`) or by `triax launch` inside srun (launch.sbatch); rank 0
prints the weights' sum, which equals a one-process run's to float64 round-off."""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from triax import Accelerator

GLOBAL_BATCH = 8

accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
inputs, targets = torch.randn(64, 16, dtype=torch.float64), torch.randn(64, 4, dtype=torch.float64)
assert GLOBAL_BATCH % accelerator.num_processes == 0, "run on 1, 2, 4 or 8 processes"
data = DataLoader(TensorDataset(inputs, targets), batch_size=GLOBAL_BATCH // accelerator.num_processes)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
for batch_inputs, batch_targets in data:
    loss = F.mse_loss(model(batch_inputs), batch_targets)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
total = sum(parameter.detach().sum().item() for parameter in accelerator.unwrap_model(model).parameters())
if accelerator.is_main_process:  # accelerator.print would print once per node, as Accelerate's does
    print(f"{accelerator.num_processes} processes: weight sum {total:.15e}")
accelerator.end_training()  # leave the process group before the interpreter exits
