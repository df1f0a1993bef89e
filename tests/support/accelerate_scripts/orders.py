"""What prepared dataloaders hand out, and what they leave in torch's generators, under one library.

python orders.py --library triax|accelerate --out DIR   (1 process, or each rank of a job)
Writes DIR/rank_<r>.json: for each case, the batches of two passes (sample ids and the random
numbers a collate function or a worker drew) and a digest of torch's global generator state after
preparing and after each pass. test_accelerate_same_numbers.py compares triax's file with
Accelerate's: they must be equal, case by case.
"""

import argparse
import hashlib
import json
import os

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler

parser = argparse.ArgumentParser()
parser.add_argument("--library", choices=["triax", "accelerate"], required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()

if args.library == "triax":
    from triax.accelerate import Accelerator, DataLoaderConfiguration
    from triax.accelerate.state import AcceleratorState, GradientState
    from triax.accelerate.utils import set_seed
else:
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import set_seed

SAMPLES = 22  # not a multiple of any global batch below: every case has a ragged last step


class Ids(Dataset):
    """Sample i is i; with `noisy`, each read also draws from torch's generator (as a random
    augmentation would), so the read order against other draws shows in the numbers."""

    def __init__(self, noisy=False):
        self.noisy = noisy

    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        if self.noisy:
            return torch.tensor([float(index), torch.rand(()).item()])
        return torch.tensor(index)


class Stream(IterableDataset):
    def __iter__(self):
        yield from (torch.tensor(i) for i in range(SAMPLES))


def noisy_collate(samples):
    # A collate function that draws (as a masking collator does): it runs one batch ahead.
    return torch.stack(samples), torch.rand(len(samples))


def digest(tensor):
    return hashlib.sha256(tensor.numpy().tobytes()).hexdigest()[:16]


def plain(batch):
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    return [plain(item) for item in batch]


def loader(case):
    options = dict(batch_size=4)
    if case == "shuffle_batch_sampler":
        return DataLoader(Ids(), batch_sampler=BatchSampler(RandomSampler(Ids()), batch_size=4, drop_last=False))
    if case.startswith("stream"):
        return DataLoader(Stream(), **options)
    if case == "noisy_collate":
        return DataLoader(Ids(), shuffle=True, collate_fn=noisy_collate, **options)
    if case == "noisy_worker":
        return DataLoader(Ids(noisy=True), shuffle=True, num_workers=1, **options)
    if case == "shuffle_generator":
        return DataLoader(Ids(), shuffle=True, generator=torch.Generator().manual_seed(5), **options)
    if case == "shuffle_drop_last":
        return DataLoader(Ids(), shuffle=True, drop_last=True, **options)
    return DataLoader(Ids(), shuffle=case != "sequential", **options)


CONFIGS = {
    "seedable": dict(use_seedable_sampler=True),
    "seedable_data_seed": dict(use_seedable_sampler=True, data_seed=7),
    "uneven": dict(even_batches=False),
    "split": dict(split_batches=True),
    "stream_per_process": dict(dispatch_batches=False),
}
CASES = ["shuffle", "sequential", "shuffle_generator", "shuffle_drop_last", "shuffle_batch_sampler", "noisy_collate",
         "noisy_worker", "stream", *CONFIGS]

record = {}
for number, case in enumerate(CASES):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(**CONFIGS.get(case, {})))
    set_seed(100 + number)
    prepared = accelerator.prepare(loader(case))
    try:
        length = len(prepared)
    except TypeError:  # a stream without a length
        length = None
    result = {"after_prepare": digest(torch.get_rng_state()), "length": length, "passes": []}
    for _ in range(2):
        batches = [plain(batch) for batch in prepared]
        result["passes"].append({"batches": batches, "rng": digest(torch.get_rng_state()),
                                 "end": accelerator.gradient_state.end_of_dataloader})
    record[case] = result

os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"rank_{accelerator.process_index}.json"), "w") as handle:
    json.dump(record, handle)
