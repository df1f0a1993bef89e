"""Accelerate's everyday surface, exercised the same way on triax.accelerate and on Hugging Face
Accelerate, for the 2-process equivalence tests (tests/unit/accelerate/test_accelerate_surface.py).

python surface.py --impl triax|accelerate --out DIR [--hostile]
Writes DIR/rank_<r>.json: what each behaviour produced on that process, and DIR/weights_<impl>.json.
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--impl", choices=("triax", "accelerate"), required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--hostile", action="store_true", help="also the cross-process failure cases (triax only)")
args = parser.parse_args()

if args.impl == "triax":
    from triax.accelerate import Accelerator, PartialState
    from triax.accelerate.utils import (
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        DistributedType,
        GradientAccumulationPlugin,
        ProjectConfiguration,
        set_seed,
    )
else:
    from accelerate import Accelerator, PartialState
    from accelerate.utils import (
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        DistributedType,
        GradientAccumulationPlugin,
        ProjectConfiguration,
        set_seed,
    )


class Ids(Dataset):
    """Sample i is (features of i, i)."""

    def __init__(self, size: int):
        generator = torch.Generator().manual_seed(7)
        self.inputs = torch.randn(size, 4, generator=generator)
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.inputs[index], index


record = {}
state = PartialState(cpu=True)  # Accelerate needs cpu=True to run several CPU processes
record["process"] = [state.process_index, state.num_processes, state.is_main_process, state.is_last_process]
record["distributed_type"] = [str(state.distributed_type.value), state.distributed_type == DistributedType.MULTI_CPU,
                              state.distributed_type == "MULTI_CPU"]


def grads_equal_across(model) -> bool:
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    everyone = [torch.zeros_like(grad) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(everyone, grad)
    return all(torch.equal(everyone[0], g) for g in everyone)


# ---- sharding and gather_for_metrics ---------------------------------------------------------------
def shards(config, size=10, batch_size=2):
    accelerator = Accelerator(dataloader_config=config)
    loader = accelerator.prepare(DataLoader(Ids(size), batch_size=batch_size))
    mine, gathered, ends = [], [], []
    for _, ids in loader:
        mine.append(ids.tolist())
        ends.append(accelerator.gradient_state.end_of_dataloader)
        gathered += accelerator.gather_for_metrics(ids).tolist()
    return {"len": len(loader), "mine": mine, "gathered": gathered, "ends": ends}


record["even"] = shards(DataLoaderConfiguration())
record["split"] = shards(DataLoaderConfiguration(split_batches=True), batch_size=4)
uneven = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
loader = uneven.prepare(DataLoader(Ids(9), batch_size=2))
record["uneven"] = {"len": len(loader), "mine": [ids.tolist() for _, ids in loader]}

# ---- accumulation: which micro-steps synchronise and step --------------------------------------------


def accumulation(plugin, **options):
    set_seed(0)
    accelerator = Accelerator(gradient_accumulation_plugin=plugin, **options)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler,
                                                              DataLoader(Ids(20), batch_size=2))
    syncs, stepped, equal = [], [], []
    for inputs, _ in loader:  # 5 batches per process
        before = model.module.weight.detach().clone() if hasattr(model, "module") else model.weight.detach().clone()
        with accelerator.accumulate(model):
            loss = model(inputs).pow(2).mean()
            accelerator.backward(loss)
            syncs.append(accelerator.sync_gradients)
            equal.append(grads_equal_across(model))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        after = model.module.weight if hasattr(model, "module") else model.weight
        stepped.append(not torch.equal(before, after))
    return {"syncs": syncs, "stepped": stepped, "grads_equal": equal,
            "scheduler_steps": scheduler.scheduler.last_epoch if hasattr(scheduler, "scheduler") else scheduler.last_epoch}


record["accumulate"] = accumulation(GradientAccumulationPlugin(num_steps=2))
record["accumulate_no_dataloader_sync"] = accumulation(GradientAccumulationPlugin(num_steps=2,
                                                                                  sync_with_dataloader=False))
record["accumulate_sync_each_batch"] = accumulation(GradientAccumulationPlugin(num_steps=2, sync_each_batch=True))
if args.impl == "triax":  # triax's preference, a named option: one scheduler step per optimizer update
    record["triax_scheduler_per_update"] = accumulation(GradientAccumulationPlugin(num_steps=2),
                                                        scheduler_steps="per_update")["scheduler_steps"]

# ---- no_sync and trigger_sync_in_backward ------------------------------------------------------------
accelerator = Accelerator()
model = accelerator.prepare(torch.nn.Linear(4, 1))
inputs = torch.full((2, 4), float(state.process_index + 1))
with accelerator.no_sync(model):
    accelerator.backward(model(inputs).sum())
no_sync_equal = grads_equal_across(model)
model.zero_grad()
with accelerator.no_sync(model):
    first = model(inputs).sum()
    second = model(inputs * 2).sum()
accelerator.backward(first)
with accelerator.trigger_sync_in_backward(model):
    accelerator.backward(second)
record["no_sync"] = {"equal_after_no_sync": no_sync_equal, "equal_after_trigger": grads_equal_across(model)}

# ---- kwargs handlers reach DistributedDataParallel ---------------------------------------------------
accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True,
                                                                         broadcast_buffers=False)])
model = accelerator.prepare(torch.nn.Linear(4, 1))
record["ddp_kwargs"] = [model.find_unused_parameters, model.broadcast_buffers]

# ---- join_uneven_inputs: process 0 has one batch more than process 1 --------------------------------
accelerator = Accelerator()
model = accelerator.prepare(torch.nn.Linear(4, 1))
optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
loader = accelerator.prepare(DataLoader(Ids(6), batch_size=2))  # 3 batches: 2 on process 0, 1 on 1
with accelerator.join_uneven_inputs([model], even_batches=False):
    batches = 0
    for inputs, _ in loader:
        accelerator.backward(model(inputs).sum())
        optimizer.step()
        optimizer.zero_grad()
        batches += 1
record["join"] = {"batches": batches, "len_after": len(loader)}

# ---- triggers: process 1 decides at its third check --------------------------------------------------
fired_at = None
for step in range(5):
    if state.process_index == 1 and step == 2:
        accelerator.set_trigger()
    if accelerator.check_trigger():
        fired_at = step
        break
record["trigger_fired_at"] = fired_at
record["trigger_after_reset"] = accelerator.check_trigger()

# ---- main_process_first ordering ---------------------------------------------------------------------
order_file = os.path.join(args.out, "order.txt")
with accelerator.main_process_first():
    with open(order_file, "a") as handle:
        handle.write(f"{state.process_index}\n")
accelerator.wait_for_everyone()
with open(order_file) as handle:
    record["order"] = handle.read().split()

# ---- decorators ---------------------------------------------------------------------------------------
record["decorators"] = [accelerator.on_main_process(lambda: "main")(), accelerator.on_last_process(lambda: "last")(),
                        accelerator.on_process(lambda: "one", process_index=1)(),
                        accelerator.on_local_main_process(lambda: "local")()]

# ---- automatic checkpoint naming, total_limit and hooks ----------------------------------------------
project = os.path.join(args.out, "project")
accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True,
                                                              total_limit=2))
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
calls = []
handle = accelerator.register_save_state_pre_hook(
    lambda models, weights, output_dir: calls.append(["save", len(models), len(weights), os.path.basename(output_dir)]))
accelerator.register_load_state_pre_hook(
    lambda models, input_dir: calls.append(["load", len(models), os.path.basename(input_dir)]))
for _ in range(3):
    accelerator.backward(model(torch.ones(1, 4)).sum())
    optimizer.step()
    optimizer.zero_grad()
    accelerator.save_state()
handle.remove()
accelerator.save_state()
accelerator.wait_for_everyone()  # Accelerate's save_state returns before the main process has written
saved_weight = (model.module if hasattr(model, "module") else model).weight.detach().clone()
with torch.no_grad():
    (model.module if hasattr(model, "module") else model).weight.zero_()
accelerator.load_state()
restored = torch.equal((model.module if hasattr(model, "module") else model).weight, saved_weight)
accelerator.wait_for_everyone()
record["checkpoints"] = {"dirs": sorted(os.listdir(os.path.join(project, "checkpoints"))), "hooks": calls,
                         "restored": restored, "iteration": accelerator.save_iteration,
                         "project_dir": os.path.basename(accelerator.project_dir)}

# ---- a loop both ways: accumulation, clipping, a scheduler that does not depend on step counts --------
set_seed(3)
accelerator = Accelerator(gradient_accumulation_steps=2)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
loader = DataLoader(Ids(24), batch_size=3, shuffle=False)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for epoch in range(2):
    for inputs, ids in loader:
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(inputs), ids % 3)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
weights = {name: tensor.tolist() for name, tensor in accelerator.get_state_dict(model).items()}
if accelerator.is_main_process:
    with open(os.path.join(args.out, "weights.json"), "w") as handle:
        json.dump(weights, handle)

# ---- failures agreed on by every process (triax) -----------------------------------------------------
if args.hostile:
    def outcome(action):
        try:
            action()
            return "ok"
        except Exception as error:  # what each process raised
            return f"{type(error).__name__}|{isinstance(error, ValueError)}|{isinstance(error, RuntimeError)}|{error}"

    rank = state.process_index
    failures = {}
    failures["gather_trailing"] = outcome(lambda: accelerator.gather(torch.zeros(2, 3 + rank)))
    failures["gather_dtype"] = outcome(lambda: accelerator.gather(torch.zeros(2, dtype=torch.float32 if rank else torch.int64)))
    failures["gather_keys"] = outcome(lambda: accelerator.gather({"a": torch.zeros(1), ("b" if rank else "c"): torch.zeros(1)}))
    failures["gather_first_dim_ok"] = outcome(lambda: accelerator.gather(torch.zeros(1 + rank, 2)))
    failures["reduce_shape"] = outcome(lambda: accelerator.reduce(torch.zeros(1 + rank)))

    def failing_main():
        with accelerator.main_process_first():
            if accelerator.is_main_process:
                raise OSError("download failed")

    failures["main_process_first"] = outcome(failing_main)
    blocker = os.path.join(args.out, "not_a_directory")
    if rank == 0:
        open(blocker, "w").close()
    accelerator.wait_for_everyone()
    target = os.path.join(blocker, "model") if rank == 0 else os.path.join(args.out, "fine")
    failures["save_model"] = outcome(lambda: accelerator.save_model(model, target))
    # A damaged RNG file of process 1 only: both processes must fail load_state together.
    saved = accelerator.save_state(os.path.join(args.out, "rngcase"))
    accelerator.wait_for_everyone()
    if rank == 0:
        with open(os.path.join(saved, "random_states_1.pkl"), "a") as handle:
            handle.write(" ")
    accelerator.wait_for_everyone()
    failures["load_state_one_rank"] = outcome(lambda: accelerator.load_state(saved))
    failures["still_in_step"] = outcome(lambda: accelerator.gather(torch.ones(1)))
    record["failures"] = failures

with open(os.path.join(args.out, f"rank_{state.process_index}.json"), "w") as handle:
    json.dump(record, handle)
sys.exit(0)
