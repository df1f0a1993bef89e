"""The 30-step fine-tune recipe the model families' e2e tests run twice: in triax, and as a plain
loop over transformers' model of the same checkpoint (torch's AdamW, transformers' cosine schedule,
clipping, and the very windows triax trained on, read back from debug.sample_log)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from support.hf_scoring import model_mean_loss


@dataclass(frozen=True)
class Recipe:
    block: int = 32
    batch: int = 4
    steps: int = 30
    every: int = 10
    lr: float = 3e-3
    warmup: int = 3
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 0.1
    clip: float = 1.0
    aux: float = 0.0  # the router's load-balancing loss weight (transformers' aux_loss), 0: off

    def overrides(self) -> dict:
        """The recipe as `triax train` keys."""
        return {"data.block_size": self.block, "trainer.batch_size": self.batch, "trainer.max_steps": self.steps,
                "trainer.eval_every": self.every, "trainer.eval_batches": 0, "trainer.log_every": self.every,
                "optim.lr": self.lr, "optim.min_lr": 0.0, "optim.warmup_steps": self.warmup,
                "optim.schedule": "cosine_hf", "optim.betas": f"[{self.betas[0]},{self.betas[1]}]",
                "optim.weight_decay": self.weight_decay, "optim.decay": "all", "trainer.grad_clip": self.clip,
                "model.router_aux_loss_coef": self.aux, "parallel.dp_replicate": 1}


def corpus_ids(directory, corpus, train_split=0.9):
    """(training ids, validation ids) as the trainer cuts the corpus: the checkpoint's tokenizer,
    the leading 90% for training."""
    from tokenizers import Tokenizer

    ids = torch.tensor(Tokenizer.from_file(str(directory / "tokenizer.json")).encode(
        open(corpus, encoding="utf-8").read(), add_special_tokens=False).ids)
    split = int(len(ids) * train_split)
    return ids[:split], ids[split:]


def transformers_fine_tune(recipe: Recipe, directory, train_ids, val_ids, sample_log) -> dict:
    """The recipe as a plain loop over transformers' model of `directory`: {step: validation loss}."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=recipe.betas, eps=1e-8,
                                  weight_decay=recipe.weight_decay)
    schedule = transformers.get_cosine_schedule_with_warmup(optimizer, recipe.warmup, recipe.steps)
    offsets = torch.arange(recipe.block + 1)
    val = {0: model_mean_loss(model.eval(), val_ids, recipe.block)[0]}
    model.train()
    for line in open(sample_log):
        step, _epoch, *starts = map(int, line.split())
        windows = train_ids[torch.tensor(starts)[:, None] + offsets].long()
        out = model(windows[:, :-1], output_router_logits=bool(recipe.aux))
        loss = F.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), windows[:, 1:].reshape(-1))
        (loss + recipe.aux * out.aux_loss if recipe.aux else loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % recipe.every == 0:
            val[step] = model_mean_loss(model.eval(), val_ids, recipe.block)[0]
            model.train()
    return val


def check_falls_as_transformers(recipe: Recipe, directory, corpus, ours: dict, sample_log, tolerance: float):
    """triax's validation losses equal transformers' loop's at every evaluation (relative
    `tolerance`), and both fall from the checkpoint's own loss, evaluation after evaluation."""
    train_ids, val_ids = corpus_ids(directory, corpus)
    theirs = transformers_fine_tune(recipe, directory, train_ids, val_ids, sample_log)
    evaluations = list(range(recipe.every, recipe.steps + 1, recipe.every))
    assert sorted(ours) == evaluations and len(open(sample_log).readlines()) == recipe.steps
    print("step, triax, transformers:", [(step, ours[step], theirs[step]) for step in ours])
    for step in ours:
        assert abs(ours[step] - theirs[step]) / theirs[step] <= tolerance, (step, ours[step], theirs[step])
    falls = [theirs[0]] + [theirs[step] for step in evaluations]
    assert all(a > b for a, b in zip(falls, falls[1:])), theirs
    mine = [ours[step] for step in evaluations]
    assert mine[0] < theirs[0] and all(a > b for a, b in zip(mine, mine[1:])), ours
