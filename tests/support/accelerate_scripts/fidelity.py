"""2-process checks of the Accelerator door against Accelerate's semantics (test_accelerate_fidelity.py).
python fidelity.py OUT_DIR  -> OUT_DIR/ok_<rank> when every check held on that process."""

import os
import sys

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from triax.accelerate import Accelerator
from triax.accelerate.utils import (DistributedOperationException, are_the_same_tensors, gather, reduce,
                                    synchronize_rng_states)


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(10)


accelerator = Accelerator(cpu=True)
rank = accelerator.process_index

# A shuffled loader with its own generator: 2 processes x batch 4 see, step by step, the samples
# one process sees with batch 8 (the order comes from the generator, drawn alike everywhere).
generator = torch.Generator()
loader = accelerator.prepare(DataLoader(list(range(24)), batch_size=4, shuffle=True, generator=generator))
generator.manual_seed(11)
two = [gather(batch).tolist() for batch in loader]
reference_generator = torch.Generator().manual_seed(11)
one = [batch.tolist() for batch in DataLoader(list(range(24)), batch_size=8, shuffle=True,
                                                generator=reference_generator)]
assert two == one, (two, one)

# A batch sampler: step k gives process r batch 2k + r; the odd last batch is repeated on process 1
# for even_batches, and gather_for_metrics drops the repeat.
sampler = BatchSampler(SequentialSampler(range(10)), batch_size=2, drop_last=False)
loader = accelerator.prepare(DataLoader(list(range(10)), batch_sampler=sampler))
mine = [batch.tolist() for batch in loader]
assert mine == ([[0, 1], [4, 5], [8, 9]] if rank == 0 else [[2, 3], [6, 7], [0, 1]]), mine
seen = []
for batch in loader:
    seen += accelerator.gather_for_metrics(batch).tolist()
assert seen == list(range(10)), seen

# An iterable dataset, as Accelerate: process 0 reads two batches per step and every process takes
# its half of them (dispatch_batches); the last step's [6..9] is cut in two.
loader = accelerator.prepare(DataLoader(Stream(), batch_size=3))
mine = [batch.tolist() for batch in loader]
assert mine == ([[0, 1, 2], [6, 7]] if rank == 0 else [[3, 4, 5], [8, 9]]), mine

# reduce: max and the mean default; a structure mismatch is Accelerate's exception where installed.
value = torch.tensor([1.0 + rank, 4.0 - rank])
assert reduce(value, "max").tolist() == [2.0, 4.0] and reduce(value).tolist() == [1.5, 3.5]
try:
    reduce(torch.zeros(2 + rank))
    raise AssertionError("a shape mismatch was not refused")
except DistributedOperationException:
    pass
try:
    from accelerate.utils.operations import DistributedOperationException as AccelerateException
except ImportError:
    AccelerateException = DistributedOperationException
try:
    gather(torch.zeros(1, 2 + rank))
    raise AssertionError("a shape mismatch was not refused")
except AccelerateException:
    pass

# synchronize_rng_states: every process continues with process 0's random stream.
torch.manual_seed(100 + rank)
synchronize_rng_states(["torch"])
assert are_the_same_tensors(torch.rand(3))

accelerator.wait_for_everyone()
with open(os.path.join(sys.argv[1], f"ok_{rank}"), "w") as handle:
    handle.write("ok")
