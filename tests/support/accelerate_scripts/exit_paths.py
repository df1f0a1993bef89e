"""Started by test_exit_teardown.py on 2 processes: an Accelerator loop that ends normally, or
raises after its last step (argv[1] == "raise"). The report below is registered before the
Accelerator exists, so it runs after triax's own exit handler (atexit runs last-registered first)
and says whether the process group was torn down by then, and how many of gloo's threads are
still runnable (none may be: they would meet a finalizing interpreter)."""

import atexit
import os
import sys

import torch
import torch.distributed as dist


@atexit.register
def report():
    runnable = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat", "rb") as handle:
                state = handle.read().rpartition(b")")[2].split()[0]
            with open(f"/proc/self/task/{task}/comm") as handle:
                runnable += handle.read().startswith(("pt_gloo", "gloo")) and state == b"R"
        except OSError:
            pass
    print(f"group alive at exit: {dist.is_initialized()}; gloo threads runnable: {runnable}", flush=True)


from triax import Accelerator  # noqa: E402

accelerator = Accelerator()
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
for _ in range(3):
    accelerator.backward(model(torch.randn(4, 8)).sum())
    optimizer.step()
    optimizer.zero_grad()
if sys.argv[1:] == ["raise"]:
    raise RuntimeError("the script failed after its last step")
