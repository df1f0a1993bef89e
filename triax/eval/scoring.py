"""What `triax eval MODEL` (triax.commands.eval) scores: the model of a trained run's newest
snapshot, or of a transformers directory (GPT-2, Llama, Qwen2, Mistral), and the summed loss and
token count over the whole of a split or of given token or text files.

Every token counts once (triax.data.windows: non-overlapping windows of the block size, the
leftover end scored by one last window). A batch whose whole fp32 logits would pass the limit
(`scoring_logits_limit`) goes through the output layer in chunks of positions, as training's loss
does (triax.objectives.chunked_logits); below it the whole logits, as before. Under torchrun each rank scores its share of the windows
with a whole copy of the model, and the summed losses and token counts are added exactly.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from fsspec.implementations.local import LocalFileSystem

from triax.data.targets import IGNORE_INDEX
from triax.data.chat import (ChatDataset, ChatEncoder, chat_template_for, encode_records, load_chat_datasets,
                             read_records)
from triax.data.text import CharDataset
from triax.data.tokenizer import BPETokenizer
from triax.data.tokens import TokenDataset, TokenFile
from triax.errors import TriaxError
from triax.objectives.chunked_logits import bounded_cross_entropy, logits_limit_mb
from triax.data.windows import evaluation_windows, mask_unscored, rank_batches
from triax.interop.hf import directory as hf
from triax.runs.chat_generate import chat_encoder
from triax.config import TrainConfig
from triax.train.data import build_data
from triax.runs.whole_model import open_model

if TYPE_CHECKING:
    from torch.utils.data import Dataset
    from tqdm import tqdm


def load_model(path: str, device: torch.device) -> tuple[torch.nn.Module, object, TrainConfig | None]:
    """(plain model in eval mode, its text codec or None, the run's config or None) of a run
    directory or a transformers directory, recognised once (triax/runs/whole_model.py)."""
    source = open_model(path, device)
    model = source.whole_model(device)
    return model, source.codec, source.run_config if source.is_triax_run else None


def chat_encoder_of(path: str, run_config: TrainConfig | None) -> ChatEncoder:
    """The chat template and tokenizer a run trained with, or a transformers directory's own."""
    if run_config is not None:
        return chat_encoder(path, run_config)
    tokenizer = hf.tokenizer_file(path)
    if tokenizer is None:
        raise TriaxError(f"{path!r} has no tokenizer.json to encode --chat files with")
    template = chat_template_for(None, hf.description_files(path), path)
    return ChatEncoder(template, BPETokenizer.from_file(tokenizer).tokenizer)


def datasets(args: argparse.Namespace, model: torch.nn.Module, vocab: object,
             run_config: TrainConfig | None) -> list[tuple[str, Dataset]]:
    """[(name, dataset)] to score: the given files, else the run's split."""

    block = args.block_size or model.config.block_size
    found = []
    for path in args.chat or []:
        encoder = chat_encoder_of(args.model, run_config)
        split = encode_records(read_records(path, "--chat"), encoder, block, "truncate")
        if not split.examples:
            raise TriaxError(f"--chat {path!r} has no conversation with an answer token within {block} tokens")
        found.append((path, ChatDataset(split.examples, block, packing=False)))  # the answers' tokens only
    for path in args.tokens or []:


        if not os.path.isfile(path):
            raise TriaxError(f"--tokens {path!r} is not a file")
        tokens = TokenFile(LocalFileSystem(), path, args.token_dtype, local=True)
        if tokens.num_tokens <= block:
            raise TriaxError(f"--tokens {path!r} holds {tokens.num_tokens} tokens, too few for one window of {block + 1}")
        found.append((path, TokenDataset(tokens, block, model.config.vocab_size)))
    for path in args.text or []:
        if vocab is None:
            raise TriaxError(f"{args.model!r} has no vocabulary or tokenizer.json to encode --text with; "
                             "give --tokens files instead")
        try:
            with open(path, encoding="utf-8") as handle:
                ids = vocab.encode(handle.read())
        except (OSError, UnicodeDecodeError) as error:
            raise TriaxError(f"--text {path!r} cannot be read as UTF-8 text ({error})") from None
        if len(ids) <= block:
            raise TriaxError(f"--text {path!r} encodes to {len(ids)} tokens, too few for one window of {block + 1}")
        found.append((path, CharDataset(torch.tensor(ids), block, vocab)))
    if found:
        return found
    if run_config is None:
        raise TriaxError(f"{args.model!r} is not a triax run, so it has no splits; give --tokens or --text files")
    data_config = run_config.data
    if args.block_size:
        data_config.block_size = args.block_size
    if data_config.task == "chat":  # the run's conversations, rendered and split as it trained on them
        chat = load_chat_datasets(data_config.path, data_config.val_path, data_config.train_split,
                                  chat_encoder(args.model, run_config), data_config.block_size, False,
                                  data_config.overlong)
        return [(f"{args.split} split", chat.val if args.split == "val" else chat.train)]
    # A run started from a checkpoint (model.init_from) encoded its text with that checkpoint's
    # codec, which it keeps in the run directory: score the same tokens it trained and evaluated on.
    try:
        data = build_data(data_config, vocab if run_config.model.init_from else None)
    except TriaxError as error:
        # The path is the run's, not this command's: say where it comes from. (A run of an older
        # triax kept it as typed, relative to the directory that run was started in.)
        where = os.path.join(args.model, "config.yaml")
        relative = (data_config.path and "://" not in data_config.path and not os.path.isabs(data_config.path))
        started = " (relative to the directory the run was started in: run this command from there)" if relative else ""
        raise type(error)(f"the run's data, data.path {data_config.path!r:.300} in {where}{started}, cannot be read: "
                          f"{error}; or score files with --text or --tokens") from None
    return run_splits(data, args.split)


def run_splits(data: object, split: str) -> list[tuple[str, Dataset]]:
    """The run's `split` (train or val), by name: a mixture's (data.sources) one per source."""
    if data.val_sources:
        return [(f"{split} split of {name}", data.val_sources[name] if split == "val" else data.train.sources[number])
                for number, name in enumerate(data.val_sources)]
    return [(f"{split} split", data.val if split == "val" else data.train)]


def scoring_logits_limit(run_config: TrainConfig | None, device: torch.device) -> float:
    """The most fp32 logits (MB) a scored batch holds at once: a triax run's parallel.max_logits_mb,
    unset (and for a transformers directory) the default of `device` (256 MB on a CPU, a quarter
    of a GPU's memory)."""
    return logits_limit_mb(run_config.parallel.max_logits_mb if run_config is not None else None, device)


def _forward(model: torch.nn.Module, ids: torch.Tensor, logits: bool = True) -> torch.Tensor:
    return model(ids, logits=logits)


def _summed_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    # The whole logits' cross-entropy, in fp32 whatever the model's dtype.
    logits = logits.float()
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


@torch.no_grad()
def score(model: torch.nn.Module, dataset: Dataset, batch_size: int, rank: int, ranks: int, device: torch.device,
          progress: tqdm | None = None, max_logits_mb: float = 0.0) -> tuple[float, int]:
    """(summed loss, scored targets) of this rank's share of `dataset`; a batch's logits in chunks of
    positions where they would pass `max_logits_mb` (0: never)."""
    total, count = 0.0, 0
    for starts, first_scored in rank_batches(evaluation_windows(dataset), batch_size, rank, ranks):
        x, y = dataset.batch(starts)
        y = mask_unscored(y, first_scored).to(device)
        total += bounded_cross_entropy(_forward, model, x.to(device), y, "sum", _summed_loss, max_logits_mb,
                                       contextlib.nullcontext).item()
        count += int((y != IGNORE_INDEX).sum())
        if progress is not None:  # batches done, the time left, and this rank's tokens per second
            progress.scored = getattr(progress, "scored", 0) + int((y != IGNORE_INDEX).sum())
            progress.set_postfix(tokens_per_s=f"{progress.scored / max(progress.format_dict['elapsed'], 1e-9):,.0f}",
                                 refresh=False)
            progress.update(1)
    return total, count
