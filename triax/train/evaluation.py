"""Evaluation during training: the validation loss per target token (and the addition task's
accuracy), and a text sample from the model, on every rank of any layout."""

from __future__ import annotations

import torch

from triax.data.addition import addition_accuracy
from triax.data.targets import IGNORE_INDEX
from triax.data.windows import evaluation_windows, rank_batches
from triax.objectives.chunked_logits import bounded_cross_entropy, logits_limit_mb
from triax.runtime.shared_decisions import gather_floats
from triax.train.step import TrainingStep


class Evaluation:
    """Evaluates and samples the model a TrainingStep trains, with its batches and loss."""

    def __init__(self, steps: TrainingStep):
        self.steps = steps
        self.config = steps.config
        self._said_why_no_sample = False

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation loss per target token over the windows `trainer.eval_batches` asks for
        (triax.data.windows: non-overlapping, spread over the whole split; 0 = all of it), each
        token counted once. Data-parallel ranks share the windows and their summed losses and
        token counts are added up exactly, so every layout and process count reports the same
        number. `val_tokens` is how many tokens were scored."""
        steps = self.steps
        figures = steps.objective.evaluate(steps.context)  # an objective's own figures (None: the token loss's)
        if figures is not None:
            return figures
        trainer, layout = self.config.trainer, steps.layout
        steps.model.eval()
        limit = trainer.eval_batches * trainer.batch_size * layout.dp if trainer.eval_batches else None
        splits = steps.data.val_sources or {None: steps.data.val}
        sums = [value for split in splits.values() for value in self._summed_loss(split, limit)]
        # Tensor- and pipeline-parallel peers hold the same sums: they scale both totals alike.
        totals = [sum(column) for column in zip(*gather_floats(sums))]
        result = {"val_loss": totals[0] / max(totals[1], 1.0),
                  "val_tokens": round(totals[1] * layout.reducing / steps.world_size)}
        if steps.data.val_sources:
            result = self._per_source(list(splits), totals)
        val = steps.data.val
        if self.config.data.task == "addition" and self.can_generate():
            result["val_accuracy"] = addition_accuracy(steps.raw_model, val, steps.device,
                                                       use_cache=self.generation_cache())
        steps.model.train()
        return result

    def _summed_loss(self, val: object, limit: int | None) -> tuple[float, float]:
        """This rank's summed token loss over its share of `val`'s evaluation windows, and the
        number of tokens it scored."""
        steps, trainer, layout = self.steps, self.config.trainer, self.steps.layout
        plan = evaluation_windows(val, limit)
        loss_sum, scored = 0.0, 0
        max_logits_mb = logits_limit_mb(self.config.parallel.max_logits_mb, steps.device)  # as training's loss
        for starts, first_scored in rank_batches(plan, trainer.batch_size, steps.dp_rank, layout.dp):
            x, y = steps.batch(val, starts, first_scored=first_scored)
            scored += int((y != IGNORE_INDEX).sum())
            if steps.parallel_model.pipelined:
                loss_sum += steps.pipeline_forward(x, y, train=False, reduction="sum").item()
                continue
            with steps.loss_context():  # the logits whole, or in chunks where training takes them so
                loss_sum += bounded_cross_entropy(steps.forward, steps.raw_model, x, y, "sum", steps.token_loss,
                                                  max_logits_mb, lambda: steps.precision.autocast(steps.device)).item()
        return loss_sum, float(scored)

    def _per_source(self, names: list, totals: list[float]) -> dict:
        """A mixture's figures: val_loss/NAME per source and val_loss, their mean weighted as the
        mixture weighs the sources (so it does not depend on how large each validation split is)."""
        steps = self.steps
        result = {"val_loss": 0.0, "val_tokens": 0}
        for number, name in enumerate(names):
            loss, tokens = totals[2 * number], totals[2 * number + 1]
            result[f"val_loss/{name}"] = loss / max(tokens, 1.0)
            result["val_loss"] += steps.data.val_weights[name] * result[f"val_loss/{name}"]
            result["val_tokens"] += round(tokens * steps.layout.reducing / steps.world_size)
        return result

    @torch.no_grad()
    def sample_text(self, prompt: str | None = None) -> str | None:
        steps = self.steps
        vocab = steps.data.vocab
        if (vocab is None or self.config.trainer.sample_tokens <= 0 or not self.can_generate()
                or not steps.objective.text_samples):  # an objective whose evaluation samples its own
            return None
        first_window = steps.data.val.batch(torch.zeros(1, dtype=torch.long))[0][0]
        prompt = prompt or vocab.decode(first_window[: min(16, steps.data.block_size)].tolist())
        idx = torch.tensor([vocab.encode(prompt)], device=steps.device)
        # The same generator seed on every rank: all ranks draw the same text (needed once the
        # model is sharded and every rank must take part in each forward).
        generator = torch.Generator(device=steps.device).manual_seed(self.config.trainer.seed)
        steps.raw_model.eval()
        with steps.precision.autocast(steps.device):
            out = steps.raw_model.generate(idx, self.config.trainer.sample_tokens, temperature=0.8,
                                           top_k=20, generator=generator, vocab_limit=len(vocab),
                                           use_cache=self.generation_cache())
        steps.raw_model.train()
        return vocab.decode(out[0].tolist())

    def sample_line(self, step: int) -> str | None:
        """What an evaluation prints besides its figures: a text sample, or (once a run) why this
        layout gives none."""
        sample = self.sample_text()
        if sample is not None:
            return f"--- sample at step {step} ---\n{sample}\n---"
        if (not self.can_generate() and not self._said_why_no_sample and self.steps.data.vocab is not None
                and self.config.trainer.sample_tokens > 0):
            self._said_why_no_sample = True  # once a run: every evaluation would repeat it
            return (f"no text sample during this run: generating token by token needs the whole model "
                    f"and all its logits on one rank, which this layout ({self.steps.layout.describe()}) "
                    f"splits; `triax generate {self.config.trainer.run_dir}` samples from it afterwards")
        return None

    def can_generate(self) -> bool:
        """Token-by-token generation needs the whole model and full logits on one rank: not
        available with pipeline stages, vocabulary-sharded logits or a sequence cut over ranks
        (`triax generate` after the run is)."""
        parallel_model = self.steps.parallel_model
        return not parallel_model.pipelined and not parallel_model.loss_parallel and self.steps.layout.cp == 1

    def generation_cache(self) -> bool:
        """Generation keeps earlier tokens' keys and values (GPT.generate's use_cache), except with
        compiled blocks, which would recompile for every new length. (Tensor-parallel runs do not
        generate: see can_generate.)"""
        return not self.config.parallel.compile
