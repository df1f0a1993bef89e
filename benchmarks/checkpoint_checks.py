"""What checking a transformers checkpoint costs at start-up (`model.init_from`, `triax eval`).

Before a model is built, triax resolves every file of the checkpoint (links, FIFOs, sizes), reads
and validates each safetensors header in Python (offsets, dtypes, shapes against the file's
length), type-checks config.json, and matches every tensor's shape and dtype against the model the
config describes (built on the meta device). None of it reads a tensor, so its cost depends on the
number of tensors, not their bytes. This measures it on checkpoints of real models' shapes
(Llama 3.1 8B and 70B, in bf16 shards as published), whose shards are sparse files: the header is
real, the tensor bytes are holes, so nothing large is written or read.

For each it prints the best of --rounds of:
- before: what the reader did before these checks (config.json, then safetensors' own `safe_open`
  of every shard, and each tensor's shape read through it);
- the checks: `init_from.resolve` (config, types, description files, headers, shapes and dtypes
  against the meta-built model), which is the whole of what fine-tuning runs before it builds;
- eval's size check: the whole model's parameters against the host's memory (a meta build);
and the difference, beside the time a fresh interpreter takes to `import torch` (the floor of any
triax start-up).

    python benchmarks/checkpoint_checks.py            # needs: a quiet machine
    python benchmarks/checkpoint_checks.py --rounds 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from safetensors import safe_open  # noqa: E402

from triax.errors import ConfigError  # noqa: E402
from triax.models import GPTConfig
from triax.interop.hf import directory as hf  # noqa: E402
from triax.models.memory import check_whole_model_fits  # noqa: E402
from triax.train import init_from  # noqa: E402

import torch  # noqa: E402

# name: (config.json fields, shards as published)
MODELS = {
    "Llama 3.1 8B (291 tensors, 4 shards)": (dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                                   num_hidden_layers=32, num_attention_heads=32,
                                                   num_key_value_heads=8), 4),
    "Llama 3.1 70B (723 tensors, 30 shards)": (dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                                                     num_hidden_layers=80, num_attention_heads=64,
                                                     num_key_value_heads=8), 30),
}


def llama_tensors(fields: dict) -> list[tuple[str, list[int]]]:
    hidden, inner, heads, kv = (fields[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                    "num_key_value_heads"))
    head = hidden // heads
    tensors = [("model.embed_tokens.weight", [fields["vocab_size"], hidden])]
    for layer in range(fields["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors += [(p + "input_layernorm.weight", [hidden]), (p + "post_attention_layernorm.weight", [hidden]),
                    (p + "self_attn.q_proj.weight", [heads * head, hidden]),
                    (p + "self_attn.k_proj.weight", [kv * head, hidden]),
                    (p + "self_attn.v_proj.weight", [kv * head, hidden]),
                    (p + "self_attn.o_proj.weight", [hidden, heads * head]),
                    (p + "mlp.gate_proj.weight", [inner, hidden]), (p + "mlp.up_proj.weight", [inner, hidden]),
                    (p + "mlp.down_proj.weight", [hidden, inner])]
    return tensors + [("model.norm.weight", [hidden]), ("lm_head.weight", [fields["vocab_size"], hidden])]


def write_sparse_checkpoint(directory: str, fields: dict, shards: int) -> None:
    """config.json, the index and bf16 shards whose headers are real and whose data are holes."""
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
              "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192},
              "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16", **fields}
    with open(os.path.join(directory, "config.json"), "w") as handle:
        json.dump(config, handle)
    tensors = llama_tensors(fields)
    per_shard = -(-len(tensors) // shards)
    weight_map = {}
    for number in range(shards):
        file = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in tensors[number * per_shard:(number + 1) * per_shard]:
            size = 2 * int(torch.Size(shape).numel())
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[name] = file
        encoded = json.dumps(header).encode()
        with open(os.path.join(directory, file), "wb") as handle:
            handle.write(len(encoded).to_bytes(8, "little") + encoded)
            handle.truncate(8 + len(encoded) + offset)  # a hole: no bytes written
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {}, "weight_map": weight_map}, handle)


def best(function, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return min(times)


def before(directory: str) -> None:
    """The reader before the checks: config.json, then safe_open each shard and every tensor's shape
    through it."""
    hf.architecture(directory)
    index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))
    handles = {file: safe_open(os.path.join(directory, file), framework="pt")
               for file in set(index["weight_map"].values())}
    for name, file in index["weight_map"].items():
        handles[file].get_slice(name).get_shape()


def size_check(config) -> None:
    """The check's cost is the same whether it refuses (a host smaller than the model) or not."""
    try:
        check_whole_model_fits(config, torch.device("cpu"), "config.json")
    except ConfigError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    import_torch = time.perf_counter() - started
    print(f"a fresh interpreter's `import torch`: {import_torch * 1e3:.0f} ms")
    print(f"{'checkpoint':42} {'before':>9} {'checks':>9} {'eval size':>10} {'added':>9}")
    for name, (fields, shards) in MODELS.items():
        with tempfile.TemporaryDirectory() as directory:
            write_sparse_checkpoint(directory, fields, shards)
            config = GPTConfig(**hf.architecture(directory))
            old = best(lambda: before(directory), args.rounds)
            checks = best(lambda: init_from.resolve(directory), args.rounds)
            size = best(lambda: size_check(config), args.rounds)
            print(f"{name:42} {old * 1e3:7.1f}ms {checks * 1e3:7.1f}ms {size * 1e3:8.1f}ms "
                  f"{(checks + size - old) * 1e3:7.1f}ms")


if __name__ == "__main__":
    main()
