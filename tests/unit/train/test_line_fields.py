"""The step line shows the figures an objective hands the console (a mixture of experts' router
loss and least-loaded expert, DPO's reward accuracy and margin), under the names the record, and so
metrics.jsonl, TensorBoard and the trackers, give them; another objective adds its own the same way."""

from types import SimpleNamespace

from triax.tracking.line_fields import LineField, shown_fields
from triax.tracking.throughput import Pace
from triax.objectives.router import term as router_metrics
from triax.train.console import Console
from triax.objectives.dpo.objective import DPOObjective

RECORD = {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "peak_mem_mb": 10.0, "router_loss": 0.01234,
          "expert_share": [0.4, 0.35, 0.2, 0.05], "expert_share_min": 0.05, "rewards/accuracies": 0.75,
          "rewards/margins": 0.125}


def console(step: int = 3, total: int = 10, task: str = "char") -> Console:
    steps = SimpleNamespace(data=SimpleNamespace(block_size=8), position=SimpleNamespace(step=step))
    shown = Console(SimpleNamespace(data=SimpleNamespace(task=task)), steps, total, 1.0, None, None, print)
    shown.pace = Pace(16, total, 0)
    return shown


def test_the_line_shows_an_objectives_fields_by_their_metric_names():
    line = console()
    line.show(router_metrics.LINE_FIELDS)
    line.show(DPOObjective.line_fields)
    text = line.line(RECORD)
    assert " | loss 2.5000 | router_loss 0.0123 | expert_share_min 0.050 | rewards/accuracies 0.750 | " \
           "rewards/margins 0.1250 | lr 1.00e-03 | " in text, text
    assert line.bar_figures == {"router_loss": "0.0123", "expert_share_min": "0.050",
                                "rewards/accuracies": "0.750", "rewards/margins": "0.1250"}


def test_without_fields_the_line_is_as_before_and_absent_figures_are_left_out():
    plain = console().line(RECORD)
    assert "router_loss" not in plain and "rewards" not in plain
    shown = console()
    shown.show([LineField("reward", ".3f"), LineField("completion_length", ".1f")])  # another objective's
    shown.show([LineField("reward", ".3f")])  # shown once however often it is handed over
    assert shown.line({**RECORD, "reward": 0.5}).count("reward 0.500") == 1
    assert "completion_length" not in shown.line(RECORD)


def test_only_numbers_are_shown():
    fields = [LineField("a"), LineField("b"), LineField("c"), LineField("d", ".1%")]
    assert shown_fields(fields, {"a": [1.0], "b": True, "c": "x", "d": 0.25}) == {"d": "25.0%"}


def test_evaluation_counts_name_what_they_count():
    """Chat and preference runs score answer tokens; DPO's evaluation counts its pairs too."""
    evaluated = {"val_loss": 1.5, "val_tokens": 120}
    assert "val_loss 1.5000 (120 tokens)" in console().line(evaluated)
    assert "val_loss 1.5000 (120 answer tokens)" in console(task="chat").line(evaluated)
    assert "val_loss 1.5000 (16 pairs, 120 answer tokens)" in console(task="preference").line(
        {**evaluated, "val_pairs": 16})
    assert console(task="preference")._samples() == "pairs" and console(task="chat")._samples() == "samples"


def test_grpo_shows_its_reward_spread_and_completion_length():
    from triax.objectives.grpo.objective import GRPOObjective

    line = console(task="grpo")
    line.show(GRPOObjective.line_fields)
    text = line.line({**RECORD, "reward": 0.5, "reward_std": 0.25, "completions/mean_length": 4.5})
    assert " | loss 2.5000 | reward 0.500 | reward_std 0.250 | completions/mean_length 4.5 | lr " in text, text
