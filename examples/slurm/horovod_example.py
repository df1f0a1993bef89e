"""A triax.horovod script whose result does not depend on how many processes run it: a global batch
of 8 fixed samples per step split across the processes, float64. Started by srun directly
(`srun python horovod_example.py`) or by `triax horovodrun` inside an allocation; rank 0 prints the
weights' sum, which equals a one-process run's to float64 round-off."""

import torch
import torch.nn.functional as F

import triax.horovod as hvd

GLOBAL_BATCH = 8

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(10, 1).double()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
inputs = torch.randn(20, GLOBAL_BATCH, 10, dtype=torch.float64)
share = GLOBAL_BATCH // hvd.size()
for step in range(20):
    x = inputs[step, hvd.rank() * share:(hvd.rank() + 1) * share]
    optimizer.zero_grad()
    F.mse_loss(model(x), x.sum(1, keepdim=True)).backward()  # Horovod averages the gradients
    optimizer.step()
total = sum(parameter.detach().sum().item() for parameter in model.parameters())
if hvd.rank() == 0:
    print(f"{hvd.size()} processes: weight sum {total:.15e}")
