"""The answer to one user message (`triax generate RUN --chat MESSAGE`): the run's model answers it,
rendered with the chat template it was trained with (data.chat_template, or the checkpoint's, kept in RUN/init_from/),
and stops at the model's end-of-turn token or any other special token, printing none. A LoRA run's
model is its base (model.init_from) with the snapshot's adapters; any other run's is its snapshot."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from triax import safe_files
from triax.errors import TriaxError

if TYPE_CHECKING:
    import tokenizers
    import torch

    from triax.data.chat import ChatEncoder
    from triax.config import TrainConfig


def run_config(run_dir: str) -> TrainConfig:
    import yaml  # deferred: `triax --help` stays fast

    from triax.config import from_dict  # deferred: `triax --help` and plain generate stay fast

    path = os.path.join(run_dir, "config.yaml")
    try:
        return from_dict(yaml.safe_load(safe_files.read_text(path)) or {})
    except Exception as error:  # noqa: BLE001 - a damaged run file is the user's to fix: one line
        raise TriaxError(f"{path!r} is not a valid run config ({type(error).__name__}); give the run directory "
                         "of a finished `triax train`") from None


def load_chat_model(run_dir: str, config: TrainConfig, device: torch.device) -> torch.nn.Module:
    """The run's trained model (a LoRA run: its base with the adapters of the newest good snapshot)."""
    from triax.checkpoint.export import tensor_source  # deferred: imports torch; `triax --help` stays fast
    # deferred: `triax --help` and plain generate stay fast
    from triax.runs.reader import load_run_model, newest_good_snapshot, run_snapshot_root

    if not config.model.lora.rank:
        return load_run_model(run_dir, device)[0]
    from triax.interop.hf.whole_model import load_hf_model  # deferred: imports torch
    from triax.models.lora import apply_lora, is_adapter  # deferred: `triax --help` and plain generate stay fast

    base = config.model.init_from
    if not base or not os.path.isdir(base):
        raise TriaxError(f"{run_dir!r} is a LoRA run whose base (model.init_from={base!r}) is not a directory here; "
                         "the adapters need the base model they were trained on")
    reader = newest_good_snapshot(run_snapshot_root(run_dir), run_dir)
    model = load_hf_model(base, device)
    apply_lora(model, config.model.lora)
    source = tensor_source(reader)
    for name, parameter in model.named_parameters():
        if is_adapter(name):
            parameter.data = source[name].to(device=device, dtype=parameter.dtype)
    return model.eval()


def chat_encoder(run_dir: str, config: TrainConfig) -> ChatEncoder:
    from triax.data.chat import ChatEncoder, chat_template_for  # deferred: start-up time of `triax generate`
    from triax.data.tokenizer import BPETokenizer  # deferred: `triax --help` and plain generate stay fast
    from triax.runs.files import kept_tokenizer  # deferred: `triax --help` and plain generate stay fast

    tokenizer_path, description = kept_tokenizer(run_dir, "--chat needs a run trained with a tokenizer")
    template = chat_template_for(config.data.chat_template, description, run_dir)
    return ChatEncoder(template, BPETokenizer.from_file(tokenizer_path).tokenizer)


def end_of_turn_ids(encoder: ChatEncoder) -> list[int]:
    """The ids that end the assistant's turn: the tokenizer's eos token (Llama 3's <|eot_id|>,
    Qwen2's <|im_end|>), and ChatML's end marker for the built-in template."""
    names = [encoder.template.special_tokens.get("eos_token"), "<|im_end|>" if "<|im_end|>" in encoder.template.source
             else None]
    ids = [encoder.tokenizer.token_to_id(name) for name in names if name]
    return [token for token in ids if token is not None]


def special_ids(tokenizer: tokenizers.Tokenizer) -> list[int]:
    """Every special token of the tokenizer (headers, begin-of-text, end markers): an answer ends at
    the first one it samples (a sampled <|start_header_id|> would begin a turn of its own) and never
    prints it."""
    return sorted(token for token, added in tokenizer.get_added_tokens_decoder().items() if added.special)


def generate_chat(run_dir: str, message: str, system: str | None, tokens: int, temperature: float,
                  top_k: int | None, greedy: bool, seed: int, device: torch.device) -> str:
    import torch  # deferred: `triax --help` stays fast

    config = run_config(run_dir)
    encoder = chat_encoder(run_dir, config)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
    prompt = encoder.encode_prompt(messages)
    model = load_chat_model(run_dir, config, device)
    if len(prompt) >= model.config.block_size:
        raise TriaxError(f"the rendered conversation is {len(prompt)} tokens, not shorter than the model's context "
                         f"{model.config.block_size}; give a shorter message")
    stop = sorted(set(end_of_turn_ids(encoder)) | set(special_ids(encoder.tokenizer)))
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(torch.tensor([prompt], device=device), min(tokens, model.config.block_size - len(prompt)),
                         temperature=temperature, top_k=top_k, greedy=greedy, generator=generator,
                         vocab_limit=min(encoder.tokenizer.get_vocab_size(), model.config.vocab_size), stop_ids=stop)
    answer = out[0, len(prompt):].tolist()
    ended = next((at for at, token in enumerate(answer) if token in stop), len(answer))
    return encoder.tokenizer.decode(answer[:ended], skip_special_tokens=True)
