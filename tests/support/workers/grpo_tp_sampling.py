"""Run by torchrun from tests/unit/objectives/test_grpo_generation.py: one checkpoint's completions
sampled by the whole model in this process and by the model sharded over the ranks by tensor
parallelism (the training layout: vocabulary-sharded logits, sequence-parallel norms); rank 0
writes both as JSON."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from triax.interop.hf.whole_model import load_hf_model
from triax.objectives.grpo.generation import CachedSampler, SamplingSettings
from triax.parallel.tensor_parallel import apply_tensor_parallel

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15], [20, 21, 22]]  # odd and even lengths


def completions(model, multiple, stop):
    settings = SamplingSettings(num_generations=3, max_completion_length=12, temperature=0.9, top_k=40, top_p=0.95,
                                stop_ids=(stop,))
    sampler = CachedSampler(model, settings, seed=7, device=torch.device("cpu"), multiple=multiple)
    return [completion.ids for completion in sampler.complete(PROMPTS, [3, 8, 11], step=2)]


def main(base: str, out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    stop = 3  # the checkpoint's end of turn
    whole = completions(load_hf_model(base, torch.device("cpu")).eval(), 1, stop)
    sharded = load_hf_model(base, torch.device("cpu")).eval()
    apply_tensor_parallel(sharded, init_device_mesh("cpu", (dist.get_world_size(),)), loss_parallel=True)
    parallel = completions(sharded, dist.get_world_size(), stop)
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump({"whole": whole, "parallel": parallel}, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
