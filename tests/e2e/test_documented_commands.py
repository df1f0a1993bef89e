"""Every shell command shown in README.md and docs/*.md runs, as written, and succeeds.

The convention, for whoever writes a page:

- A fenced block in `bash` (or `shell`, `sh`) is commands: each line (a trailing `\\` continues it)
  is run by bash, page by page, in order, in a fresh copy of a prepared directory (below), so a
  later command may use what an earlier one on the same page made. Comment lines are prose.
- A `console` block is a transcript: `$ command` lines, each followed by its exact output
  (a line `...` stands for any lines).
- Output, file trees and anything else that is not a command goes in a `text` block (or any other
  language); a block without a language must not hold a command (checked below).
- A command that cannot run on a CPU machine with no network says so on its own line, visibly:
  a trailing comment with `needs: <what>` (`# 4 hosts; needs: several machines`), or, for a whole
  block, a first line `# needs: <what>`. Such commands are not run, and NOT_RUN below lists each
  one with its reason: a new one is added there on purpose, never silently.

How a command runs here (tests/support/command_shims.py has the details):

- `triax` and `torchrun` on PATH are the harness's own: they fork the command from a server that
  imported triax once (seconds saved per command), torchrun's ranks with torchrun's environment.
- `triax train`, alone or under torchrun, is scaled down: at most 4 steps of a 2-layer, 32-wide
  model on small batches (command_shims.MODEL_SHAPE, AT_MOST), and `triax launch` without a port of
  its own gets a free one (`--main-process-port 0`: the default 29500 would collide between two test
  sessions on one machine); nothing else in a command is changed.
- The directory holds what the pages refer to: `input.txt`, `other.txt`, `more/*.txt`, a tiny
  transformers GPT-2 with its tokenizer in `path/to/gpt2/`, nanoGPT-layout token files in
  `nanogpt/data/openwebtext/`, a tiny Llama in Meta's layout as Meta's folder (`path/to/Llama-debug/`) and as
  torchtitan's checkpoints (`outputs/checkpoint/step-10/`) with token files for it in `llama_tokens/` (all
  four made by the stand-in scripts docs/switching.md ships, STAND_INS: a page that runs one starts
  without what it makes), llm.c shards in `fineweb10B/` and a Megatron dataset `megatron/code_text_document`,
  `val.bin`, the README's Accelerate example as `demo.py` (and as the
  module `my_package.train`), its Horovod example as `train.py`, the repository's `examples/`, and
  `runs/gpt/`, made by the quickstart's own `triax train`. HOME is that directory too (`~` and `~/.cache` stay inside it).
  A page that runs the quickstart itself (a bare `triax train`: the README, Getting started) starts
  without `runs/`, so its commands run in order as a new user runs them.
  Questions a command asks are answered with Enter (each default).
- A multi-process `triax train` (torchrun, `triax launch`) beside a one-process one of the same
  model and data in its block trains as many steps (the same `trainer.max_steps`), or says why in
  a trailing comment that names the steps: as written, a user runs both.
- No command may resume a finished run by accident (`... is already complete`): a page's
  `triax train` that is not the quickstart names a trainer.run_dir of its own (or is part of a
  sequence meant to resume), and every command that trains must show a step run (TRAINS).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import command_shims
from triax.testing import quiet_env
from support import REPO_DIR, SUPPORT_DIR

ROOT = Path(REPO_DIR)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGUAGES = ("bash", "shell", "sh")
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
NEEDS = re.compile(r"(?:^|\s)#(?:[^#]*[\s;])?needs: ([^#]+?)\s*$")
COMMAND_TIMEOUT = 300
QUICKSTART = "triax train"
COMPLETE = "is already complete"  # what a finished run started again says (triax.train.console)
# A command that trains (`triax train`, alone or under torchrun or a script: not --help) must show
# a step run: the trainer's summary, or a stop after a step (a run meant to be resumed).
TRAINS = re.compile(r"(?:^|[\s;&|(])(?:-m )?triax train(?=\s|$)|examples/slurm/train\.sbatch")
# A multi-process `triax train` and the one-process ones it is compared with; SAME_RUN: the keys
# that make two commands the same run (the model and the data).
MULTI_PROCESS_TRAIN = re.compile(r"^(?:torchrun|triax launch)\b.*\s-m triax train(?=\s|$)")
ONE_PROCESS_TRAIN = re.compile(r"^triax train(?=\s|$)")
SAME_RUN = ("model", "model.init_from", "data.task", "data.path")
STEPS_RUN = re.compile(r"done: [1-9]\d* steps? in|stopped by .* after step [1-9]")

# The repository's stand-ins for another tool's files (docs/switching.md), with their arguments here,
# and what each makes in the prepared directory.
STAND_INS = {
    "nanogpt_data.py nanogpt/data/openwebtext": ("nanogpt",),
    "meta_llama_folder.py path/to/Llama-debug --tokens llama_tokens": ("path/to/Llama-debug", "llama_tokens"),
    "torchtitan_checkpoint.py outputs/checkpoint": ("outputs",),
}

# Every command not run here, by page, and why (the `needs:` on its line or block).
NOT_RUN = {
    ('README.md', 'bash scripts/test.sh'): 'network',
    ('README.md', 'bash scripts/test.sh -m "not multiprocess"'): 'network',
    ('README.md', "python3 -m pip install -e '.[docs]' && mkdocs serve"): 'network',
    ('README.md', "python3 -m pip install -e '.[wandb,mlflow]'"): 'network',
    ('README.md', 'python3 -m pip install torch==2.13.0 -e .'): 'network',
    ('docs/accelerate.md', 'triax launch --num-machines 2 --machine-rank 0 --main-process-ip 10.0.0.1 --main-process-port 29500 train.py'): 'several machines',
    ('docs/doctor.md', 'torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint head:29500 -m triax doctor parallel.dp_shard=8'): 'several machines',
    ('docs/clusters.md', 'mkdir -p /tmp/cluster && scripts/slurm_cluster.sh up --dir /tmp/cluster --nodes 2'): 'root and slurm-wlm',
    ('docs/clusters.md', 'sbatch examples/slurm/horovodrun.sbatch examples/slurm/horovod_example.py'): 'a Slurm cluster',
    ('docs/clusters.md', 'sbatch examples/slurm/launch.sbatch -m triax train trainer.run_dir=runs/slurm trainer.max_steps=2000'): 'a Slurm cluster',
    ('docs/clusters.md', 'sbatch examples/slurm/launch.sbatch examples/slurm/accelerator_example.py'): 'a Slurm cluster',
    ('docs/clusters.md', 'sbatch examples/slurm/srun.sbatch examples/slurm/accelerator_example.py'): 'a Slurm cluster',
    ('docs/clusters.md', 'sbatch examples/slurm/srun.sbatch examples/slurm/horovod_example.py'): 'a Slurm cluster',
    ('docs/clusters.md', 'sbatch examples/slurm/train.sbatch trainer.run_dir=runs/slurm trainer.max_steps=2000'): 'a Slurm cluster',
    ('docs/clusters.md', 'scripts/slurm_cluster.sh down --dir /tmp/cluster'): 'root and slurm-wlm',
    ('docs/clusters.md', 'scripts/slurm_cluster.sh exec --dir /tmp/cluster sbatch examples/slurm/train.sbatch trainer.max_steps=50'): 'root and slurm-wlm',
    ('docs/clusters.md', 'scripts/slurm_cluster.sh exec --dir /tmp/cluster squeue'): 'root and slurm-wlm',
    ('docs/getting-started.md', 'bash scripts/test.sh'): 'network',
    ('docs/getting-started.md', 'bash scripts/test.sh -m "not multiprocess"'): 'network',
    ('docs/getting-started.md', 'python3 -m pip install torch==2.13.0 && python3 -m pip install -e .'): 'network',
    ('docs/horovod.md', 'mpirun -np 2 python train.py'): 'MPI',
    ('docs/horovod.md', 'triax horovodrun -np 4 --min-np 2 --max-np 8 --host-discovery-script ./discover_hosts.sh python train.py'): 'several machines',
    ('docs/horovod.md', 'triax horovodrun -np 8 -H node1:4,node2:4 python train.py'): 'several machines',
    ('docs/llama.md', 'OMP_NUM_THREADS=1 python benchmarks/vs_transformers_llama.py --rounds 3 --steps 200'): 'a quiet machine',
    ('docs/moe.md', 'OMP_NUM_THREADS=1 python benchmarks/moe_vs_transformers.py --rounds 3 --steps 20'): 'a quiet machine',
    ('docs/moe.md', 'python benchmarks/moe_memory.py --steps 3'): 'a quiet machine',
    ('docs/gpt-oss.md', 'triax train model.init_from=path/to/gpt-oss-20b data.path=input.txt parallel.dp_shard=8 parallel.ep=8 trainer.run_dir=runs/gpt-oss-20b'): 'the released checkpoint (13 GB)',
    ('docs/phi3.md', 'triax train model.init_from=path/to/phi-4 data.path=input.txt parallel.dp_shard=8 trainer.run_dir=runs/phi-4'): 'a Phi-3 or Phi-4 checkpoint',
    ('docs/data.md', 'OMP_NUM_THREADS=1 python benchmarks/document_masking.py'): 'a quiet machine',
    ('docs/data.md', 'OMP_NUM_THREADS=1 python benchmarks/document_masking.py --block 1024 --batch 2 --rounds 3'): 'a quiet machine',
    ('docs/data.md', 'python benchmarks/tokenize_workers.py'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/moe_memory.py --steps 3'): 'a quiet machine',
    ('docs/parallelism.md', 'python benchmarks/allocator_cost.py'): 'a quiet machine',
    ('docs/parallelism.md', 'python benchmarks/context_memory.py'): 'a quiet machine',
    ('docs/parallelism.md', 'python benchmarks/memory_scaling.py'): 'a quiet machine',
    ('docs/parallelism.md', 'python benchmarks/memory_scaling.py --model gpt2-large --shards 4 --phases construct step'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/dpo_vs_trl.py --rounds 3 --steps 60'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/dpo_vs_trl.py --quality --steps 60'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/grpo_vs_trl.py --rounds 3 --steps 20'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/grpo_reward_vs_trl.py'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/grpo_reward_vs_trl.py --seeds 10'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/grpo_memory.py'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/sft_memory.py'): 'a quiet machine',
    ('docs/performance.md', 'OMP_NUM_THREADS=1 python benchmarks/lora_vs_peft.py --rounds 3 --steps 100'): 'a quiet machine',
    ('docs/performance.md', 'OMP_NUM_THREADS=1 python benchmarks/moe_vs_transformers.py --rounds 3 --steps 20'): 'a quiet machine',
    ('docs/performance.md', 'OMP_NUM_THREADS=1 python benchmarks/pipe_overlap.py --repeats 5'): 'a quiet machine',
    ('docs/performance.md', 'OMP_NUM_THREADS=1 python benchmarks/vs_transformers_llama.py --rounds 3 --steps 200'): 'a quiet machine',
    ('docs/performance.md', 'OMP_NUM_THREADS=1 python benchmarks/snapshot_bench.py --ranks 1,2,4 --model gopher-44m --skip-snapshot --skip-training'): 'a quiet machine',
    ('docs/performance.md', 'OMP_NUM_THREADS=2 python benchmarks/snapshot_bench.py --skip-snapshot --rounds 4'): 'a quiet machine',
    ('docs/performance.md', 'pip install -e ".[bench]"'): 'network',
    ('docs/performance.md', 'triax doctor --gpu-suite --json gpu-suite.json --budget 300'): 'a GPU',
    ('docs/doctor.md', 'triax doctor --gpu-suite --json gpu-suite.json'): 'a GPU',
    ('docs/performance.md', 'python benchmarks/slurm_timings.py --repeats 3'): 'root and slurm-wlm on a quiet machine',
    ('docs/performance.md', 'python -m pytest tests/unit/runtime/test_watchdog.py -k cut_link -s'): 'root',
    ('docs/performance.md', 'python benchmarks/accelerator_vs_hf.py --rounds 3 --steps 30'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/bpe_vs_char.py path/to/tinyshakespeare.txt --steps 200 --vocab-size 1024'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/allocator_cost.py --model gpt-mini --nproc 2 --steps 20 --set parallel.dp_replicate=1 parallel.dp_shard=2'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/compression_convergence.py --model gpt-mini --steps 200 --batch-size 8 --block-size 64'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/compression_convergence.py --model gpt-mini --steps 200 --batch-size 8 --block-size 64 --compressions powersgd --powersgd-rank 8'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/generation_cache.py'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/horovod_vs_ddp.py --rounds 5 --steps 10'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/memory_scaling.py'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/memory_scaling.py --model gpt2-large --shards 2 1'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/memory_scaling.py --model gpt2-large --shards 4'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/parallel_layouts.py --steps 4 28'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/pipeline_bubble.py'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/thread_default.py --steps 40 --rounds 2'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/trainer_vs_handwritten.py'): 'a quiet machine',
    ('docs/performance.md', 'python benchmarks/trainer_vs_handwritten.py --only-precision --precision-model gpt-mini --steps 5'): 'a quiet machine',
    ('docs/performance.md', 'sudo python benchmarks/ddp_boost_netns.py --rounds 2 --steps 10 --compressions bf16 fp16'): 'root',
    ('docs/performance.md', 'sudo python benchmarks/ddp_boost_netns.py --rounds 2 --steps 10 --compressions powersgd'): 'root',
    ('docs/performance.md', 'sudo python benchmarks/netns_compression.py --model gpt-mini --batch-size 4 --block-size 64 --rates 1gbit,100mbit --warmup 12 --steps 3 --repeats 5'): 'root',
    ('docs/performance.md', 'sudo scripts/netns.sh down'): 'root',
    ('docs/performance.md', 'sudo scripts/netns.sh exec 0 torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=10.213.7.1:29477 --rdzv-conf=is_host=1 --local-addr=10.213.7.1 -m triax train ...'): 'root',
    ('docs/performance.md', 'sudo scripts/netns.sh exec 1 torchrun ... --rdzv-conf=is_host=0 --local-addr=10.213.7.2 -m triax train ...'): 'root',
    ('docs/performance.md', 'sudo scripts/netns.sh up --nodes 2 --rate 100mbit'): 'root',
    ('docs/performance.md', 'torchrun --nnodes=2 ... -m triax train parallel.grad_compression=powersgd parallel.powersgd_rank=4'): 'several machines',
    ('docs/performance.md', 'triax bench --impls ddp,triax,triax:bf16,triax:powersgd::4'): 'a quiet machine',
    ('docs/performance.md', 'triax bench --model gpt-mini --nproc 1,2 --batch-size 8 --block-size 128 --repeats 5 --out bench-results'): 'a quiet machine',
    ('docs/performance.md', 'triax bench --model gpt-mini --nproc 1,2 --batch-size 8 --block-size 128 --warmup 3 --steps 4 --repeats 5'): 'a quiet machine',
    ('docs/performance.md', 'triax bench --model mlp --nproc 1,2,4 --precision bf16'): 'a quiet machine',
    ('docs/tracking.md', 'triax train trainer.loggers=[jsonl,wandb] trainer.project=python-source trainer.run_name=baseline'): 'a W&B account',
}


@dataclass
class Command:
    page: str
    text: str  # as bash gets it (continuations joined)
    needs: str | None  # why it is not run here, from its `needs:` mark
    expected: str | None = None  # a console block's output
    block: int = 0  # which fenced block of the page holds it

    @property
    def bare(self) -> str:
        """The command without its trailing comment."""
        return re.sub(r"\s+#(\s.*)?$", "", self.text)


def _joined(lines: list[str]) -> list[str]:
    joined, current = [], ""
    for line in lines:
        if current:
            current += " " + line.strip()
        else:
            current = line
        if current.endswith("\\"):
            current = current[:-1].rstrip()
            continue
        joined.append(current)
        current = ""
    return joined + ([current] if current else [])


def page_commands(page: Path) -> list[Command]:
    name = str(page.relative_to(ROOT))
    found = []
    for block, (language, body) in enumerate(FENCE.findall(page.read_text())):
        lines = _joined(body.splitlines())
        if language in SHELL_LANGUAGES:
            block_needs = None
            for number, line in enumerate(lines):
                stripped = line.strip()
                if not stripped:
                    continue
                if stripped.startswith("#"):
                    mark = NEEDS.search(stripped)
                    if mark and not any(earlier.strip() and not earlier.strip().startswith("#")
                                        for earlier in lines[:number]):
                        block_needs = mark.group(1).strip()
                    continue
                mark = NEEDS.search(stripped)
                found.append(Command(name, stripped, mark.group(1).strip() if mark else block_needs, block=block))
        elif language == "console":
            starts = [number for number, line in enumerate(lines) if line.startswith("$ ")]
            for start, end in zip(starts, [*starts[1:], len(lines)]):
                text = lines[start][2:].strip()
                mark = NEEDS.search(text)
                found.append(Command(name, text, mark.group(1).strip() if mark else None,
                                     "\n".join(lines[start + 1:end]).strip(), block))
    return found


def test_commands_are_in_labelled_blocks():
    """A block without a language is neither run nor skipped: a command there would escape."""
    command = re.compile(r"^\s*(\$ |triax |torchrun |python3? |pip |bash |sudo )")
    unlabelled = [f"{page.relative_to(ROOT)}: {line.strip()}" for page in PAGES
                  for language, body in FENCE.findall(page.read_text()) if not language
                  for line in body.splitlines() if command.match(line)]
    assert not unlabelled, ("commands in a fenced block without a language; label it bash (run) or "
                            "text (not a command):\n" + "\n".join(unlabelled))


def test_commands_not_run_here_are_the_listed_ones():
    marked = {(command.page, command.bare): command.needs
              for page in PAGES for command in page_commands(page) if command.needs}
    for (page, text), needs in sorted(marked.items()):
        print(f"not run: {page}: {text}   [needs: {needs}]")
    assert marked == NOT_RUN, ("the commands marked `needs:` changed; if on purpose, update NOT_RUN in "
                               f"{Path(__file__).name} to:\n" + "\n".join(
                                   f"    ({page!r}, {text!r}): {needs!r}," for (page, text), needs in
                                   sorted(marked.items())))


def _settings(text: str) -> dict[str, str]:
    """The key=value overrides of a command."""
    return dict(word.split("=", 1) for word in shlex.split(text, comments=True)
                if "=" in word and not word.startswith("-"))


def test_multi_process_commands_train_as_long_as_their_one_process_sibling():
    """A page that shows a run and then "the same on two processes" shows a run as long: as written,
    a multi-process command without the sibling's trainer.max_steps trains the default 500 steps.
    Its sibling: a one-process `triax train` of the same block with the same model and data. A
    command that means to differ says so in a trailing comment naming the steps."""
    surprises = []
    for page in PAGES:
        commands = page_commands(page)
        for command in commands:
            if not MULTI_PROCESS_TRAIN.match(command.bare) or re.search(r"#.*\bsteps?\b", command.text):
                continue
            settings = _settings(command.bare.split(" -m triax train", 1)[1])
            siblings = [_settings(other.bare) for other in commands if other.block == command.block
                        and ONE_PROCESS_TRAIN.match(other.bare)]
            siblings = [other for other in siblings if all(other.get(key) == settings.get(key) for key in SAME_RUN)]
            steps = {other.get("trainer.max_steps") for other in siblings}
            if siblings and settings.get("trainer.max_steps") not in steps:
                surprises.append(f"{command.page}: {command.bare} (trainer.max_steps="
                                 f"{settings.get('trainer.max_steps', 'the default')}, its sibling's {steps})")
    assert not surprises, ("multi-process commands that train longer or shorter than their one-process "
                           "sibling; give them its trainer.max_steps, or say why in a comment:\n" + "\n".join(surprises))


# ---- the prepared directory -----------------------------------------------------------------------

def _words(seed: int, lines: int) -> str:
    import random

    rng = random.Random(seed)
    words = ["the", "king", "queen", "and", "my", "lord", "def", "what", "shall", "we", "do", "now",
             "ROMEO:", "JULIET:", "thou", "art", "sweet", "night", "day", "is", "not", "to", "be"]
    return "\n".join(" ".join(rng.choice(words) for _ in range(10)) for _ in range(lines)) + "\n"


def _readme_example(marker: str) -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    return next(block for block in blocks if marker in block)


def _tiny_gpt2(directory: Path, corpus: Path) -> None:
    """A transformers GPT-2 (2 layers, 32 wide, random weights) as save_pretrained writes it, with a
    byte-level BPE tokenizer.json trained on `corpus`: what model.init_from and `triax eval` read."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(corpus)], trainers.BpeTrainer(vocab_size=320,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=tokenizer.get_vocab_size(), n_positions=256, n_embd=32, n_layer=2, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))


def _token_file(path: Path, count: int, vocab: int, seed: int) -> None:
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    np.random.default_rng(seed).integers(0, vocab, count, dtype=np.uint16).tofile(path)


def _other_token_formats(base: Path) -> None:
    """docs/data.md's sources: llm.c shards of GPT-2 tokens in fineweb10B/ and a Megatron dataset in megatron/."""
    import numpy as np
    from support.token_formats import split_documents, write_megatron, write_shard

    (base / "fineweb10B").mkdir()
    (base / "megatron").mkdir()
    rng = np.random.default_rng(5)
    for name, count in (("fineweb_train_000001", 12000), ("fineweb_train_000002", 8000), ("fineweb_val_000000", 4000)):
        write_shard(base / "fineweb10B" / f"{name}.bin", rng.integers(0, 50257, count))
    write_megatron(base / "megatron" / "code_text_document", split_documents(rng.integers(0, 50257, 20000), 6,
                                                                             shortest=50, longest=800))


@pytest.fixture(scope="session")
def command_server(tmp_path_factory):
    """(the environment every command runs in but for HOME, the shim directory)."""
    scratch = tmp_path_factory.mktemp("commands")
    shims = scratch / "bin"
    shims.mkdir()
    command_shims.write_shims(str(shims))
    socket_path = str(scratch / "server.sock")
    env = quiet_env()
    env["PYTHONPATH"] = os.pathsep.join([SUPPORT_DIR, env["PYTHONPATH"]])
    server = subprocess.Popen([sys.executable, "-c", f"import command_shims; command_shims.serve({socket_path!r})"],
                              env=env, stdin=subprocess.PIPE)
    env = quiet_env()
    env.update(PATH=os.pathsep.join([str(shims), os.path.dirname(sys.executable), env["PATH"]]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **{command_shims.SERVER_VARIABLE: socket_path})
    for name in ("TRIAX_CONFIG_FILE", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "TRIAX_DEBUG"):
        env.pop(name, None)
    deadline = time.monotonic() + 120
    while not os.path.exists(socket_path):  # the server imports torch before it listens
        assert server.poll() is None and time.monotonic() < deadline, "the command server did not start"
        time.sleep(0.1)
    try:
        yield env
    finally:
        server.stdin.close()
        server.wait(timeout=60)


def run_line(text: str, directory: Path, env: dict) -> subprocess.CompletedProcess:
    """One command as bash runs it, in `directory` (also HOME); every question answered with Enter."""
    env = dict(env, HOME=str(directory))
    process = subprocess.Popen(["bash", "-o", "pipefail", "-c", text], cwd=directory, env=env, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate("\n" * 100, timeout=COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"timed out after {COMMAND_TIMEOUT} s: {text}\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(text, process.returncode, stdout, stderr)


@pytest.fixture(scope="session")
def prepared(command_server, tmp_path_factory):
    """The directory every page starts from (a copy each): the files the pages refer to."""
    base = tmp_path_factory.mktemp("workspace")
    (base / "input.txt").write_text(_words(0, 400))
    (base / "other.txt").write_text(_words(1, 60))
    (base / "more").mkdir()
    (base / "more" / "extra.txt").write_text(_words(2, 60))
    (base / "path" / "to" / "gpt2").mkdir(parents=True)
    _tiny_gpt2(base / "path" / "to" / "gpt2", base / "input.txt")
    _token_file(base / "val.bin", 2000, 300, seed=0)
    for script in STAND_INS:  # the stand-ins docs/switching.md ships, for the pages that only name their files
        result = run_line(f"python {ROOT / 'examples' / script}", base, command_server)
        assert result.returncode == 0, result.stderr[-4000:]
    _other_token_formats(base)
    (base / "demo.py").write_text(_readme_example("from triax import Accelerator"))
    (base / "my_package").mkdir()
    (base / "my_package" / "__init__.py").write_text("")
    (base / "my_package" / "train.py").write_text(_readme_example("from triax import Accelerator"))
    (base / "train.py").write_text(_readme_example("import triax.horovod as hvd"))
    (base / "examples").symlink_to(ROOT / "examples")  # pages run the repository's example scripts
    result = run_line(QUICKSTART, base, command_server)  # the quickstart's run: runs/gpt
    assert result.returncode == 0, result.stderr[-4000:]
    return base


@pytest.mark.multiprocess
@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_documented_commands_run(page, prepared, command_server, tmp_path):
    commands = [command for command in page_commands(page) if not command.needs]
    if not commands:
        pytest.skip(f"{page.name} shows no command that runs here")
    directory = tmp_path / "work"
    shutil.copytree(prepared, directory, symlinks=True)
    if any(command.bare == QUICKSTART for command in commands):  # the page makes runs/gpt itself
        shutil.rmtree(directory / "runs")
    for script, made in STAND_INS.items():  # a page that runs a stand-in starts without what it makes
        if any(f"examples/{script.split()[0]}" in command.bare for command in commands):
            for path in made:
                shutil.rmtree(directory / path, ignore_errors=True)
    for command in commands:
        started = time.perf_counter()
        result = run_line(command.text, directory, command_server)
        print(f"{time.perf_counter() - started:6.1f} s  {command.text}")
        output = (result.stdout + result.stderr).strip()
        assert COMPLETE not in output, (f"{command.page}: `{command.text}` trained nothing: it resumed a finished "
                                        f"run; give it a trainer.run_dir of its own\n{output[-2000:]}")
        if command.expected is None and TRAINS.search(command.bare) and " --help" not in command.bare:
            assert STEPS_RUN.search(output), (f"{command.page}: `{command.text}` trained nothing (no step ran)\n"
                                              f"{output[-2000:]}")
        if command.expected is None:
            assert result.returncode == 0, (f"{command.page}: `{command.text}` exited {result.returncode}\n"
                                            f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n"
                                            f"{result.stderr[-3000:]}")
        else:
            pattern = "\n".join(".*" if line == "..." else re.escape(line) for line in command.expected.splitlines())
            assert re.fullmatch(pattern, output, re.DOTALL), (f"{command.page}: `{command.text}` printed\n{output}\n"
                                                             f"--- expected ---\n{command.expected}")
