"""`triax eval RUN` for a DPO run (data.task=preference), or `triax eval RUN --preference FILE...`:
TRL's DPO metrics of the trained adapters against the run's reference (the base with the adapters
off, or model.lora.init_from's adapters), over the run's validation pairs or the given files."""

from __future__ import annotations

import json

import torch

from triax.data.chat import read_records
from triax.data.preference import PreferenceDataset, encode_pairs, load_preference_datasets, preference_encoder_for
from triax.data.tokenizer import BPETokenizer
from triax.errors import TriaxError, printable
from triax.interop.hf.whole_model import load_hf_model
from triax.models.lora_config import is_adapter
from triax.objectives.chunked_logits import logits_limit_mb
from triax.interop.peft.adapter import load_adapter
from triax.objectives.dpo.loss import METRICS
from triax.objectives.dpo.objective import DPOObjective
from triax.objectives.reference import reference_for
from triax.runs.files import kept_tokenizer


def preference_encoder_of_run(run_dir: str, config):
    """The tokenizer and chat template a preference run kept in its directory."""
    tokenizer_path, description = kept_tokenizer(run_dir, "a preference run keeps its checkpoint's")
    return preference_encoder_for(config.data.chat_template, description, run_dir,
                                  BPETokenizer.from_file(tokenizer_path).tokenizer)


def _objective(model, config, device):
    """The DPO objective with the run's reference: model.lora.init_from's adapters if it had them,
    model.init_from itself for a run without LoRA; the logits in chunks above the run's
    parallel.max_logits_mb (unset: the default of `device`), as in training."""
    objective = DPOObjective(config.dpo, logits_limit_mb(config.parallel.max_logits_mb, device))
    lora = config.model.lora
    trained = None
    if lora.init_from:  # the reference's adapters are read in, kept, and the trained ones put back
        trained = {name: parameter.detach().clone() for name, parameter in model.named_parameters() if is_adapter(name)}
        load_adapter(model, lora.init_from, lora)
    objective.use_reference(reference_for(lora, model, lambda: load_hf_model(config.model.init_from, device).eval()))
    if trained is not None:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name in trained:
                    parameter.copy_(trained[name])
    return objective


def evaluate_preference(args, model, config, device) -> int:
    """Score the pairs on this process alone and print the metrics (rank 0)."""
    encoder = preference_encoder_of_run(args.model, config)
    block = args.block_size or config.data.block_size
    if args.preference:
        found = []
        for path in args.preference:
            split = encode_pairs(read_records(path, "--preference"), encoder, block, config.data.truncation_mode)
            if not split.pairs:
                raise TriaxError(f"--preference {path!r} has no pair whose prompt fits {block} tokens")
            found.append((path, PreferenceDataset(split.pairs, block, config.data.truncation_mode)))
    else:
        data = load_preference_datasets(config.data.path, config.data.val_path, config.data.train_split, encoder,
                                        block, config.data.truncation_mode)
        found = [(f"{args.split} split", data.val if args.split == "val" else data.train)]
    objective = _objective(model, config, device)
    sums, pairs = torch.zeros(len(METRICS) + 1, dtype=torch.float64), 0
    for _, dataset in found:
        for start in range(0, len(dataset), args.batch_size):
            x, y = dataset.batch(list(range(start, min(start + args.batch_size, len(dataset)))))
            losses, stats = objective.pair_terms_plain(model, x.to(device), y.to(device))
            sums += torch.cat([losses[:, None], stats], dim=1).double().sum(dim=0).cpu()
            pairs += len(losses)
    means = (sums / pairs).tolist()
    result = {"model": args.model, "data": [name for name, _ in found], "pairs": pairs, "loss": means[0],
              **dict(zip(METRICS, means[1:]))}
    if args.json:
        print(json.dumps(result))
    else:
        print(printable(f"{', '.join(result['data'])}: {pairs} pairs, DPO loss {means[0]:.4f}, reward accuracy "
                        f"{100 * result['rewards/accuracies']:.1f}%, margin {result['rewards/margins']:.4f} "
                        f"(chosen {result['rewards/chosen']:.4f}, rejected {result['rewards/rejected']:.4f})"))
    return 0
