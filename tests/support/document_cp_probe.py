"""Run by test_document_masking on 2 ranks: a transformers Llama checkpoint loaded by triax, its
sequence cut over the ranks by context parallelism, scores one packed window. Prints the window's
summed loss, the ranks' parts added, with the documents masked and without.

argv: CHECKPOINT_DIR WINDOW.npz (arrays x, y, documents: one window's inputs, targets, numbers)."""

import json
import os
import sys

# Run by path, so put this checkout (not an installed triax) first on the path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from triax.data.targets import IGNORE_INDEX  # noqa: E402
from triax.interop.hf.whole_model import load_hf_model  # noqa: E402
from triax.parallel.context_parallel import apply_context_parallel, local_chunks  # noqa: E402
from triax.runtime.process_group import init_distributed, shutdown_distributed  # noqa: E402


def main():
    device = torch.device("cpu")
    init_distributed(device)
    degree, rank = dist.get_world_size(), dist.get_rank()
    model = apply_context_parallel(load_hf_model(sys.argv[1], device).eval(), init_device_mesh("cpu", (degree,)))
    window = np.load(sys.argv[2])
    x, y, documents = (torch.from_numpy(window[name]).long() for name in ("x", "y", "documents"))
    losses = {}
    with torch.no_grad():
        for name, numbers in (("packed", documents), ("unmasked", None)):
            # Each rank its slice of the inputs and targets; the document numbers of the whole window.
            logits = model(local_chunks(x, rank, degree), documents=numbers)
            mine = F.cross_entropy(logits.reshape(-1, logits.size(-1)).double(),
                                   local_chunks(y, rank, degree).reshape(-1), ignore_index=IGNORE_INDEX,
                                   reduction="sum")
            dist.all_reduce(mine)
            losses[name] = mine.item()
    if rank == 0:
        print("PROBE " + json.dumps(losses), flush=True)
    shutdown_distributed()


if __name__ == "__main__":
    main()
