"""The figures an objective adds to the step line and the progress bar.

The console line of a logged step shows the same figures for every run (loss, lr, gnorm, speed,
memory); an objective that logs more (a mixture of experts' router loss, DPO's reward accuracy,
GRPO's rewards) names the few of its metrics a person watches as LineFields and hands them to the
console (`Console.show`), which prints each one present in a step's record. The label on the line
is the metric's own name, so the figure on the console is found under the same name in
metrics.jsonl, TensorBoard and every tracker.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LineField:
    """One metric of the step's record shown on the console line and the bar."""

    name: str  # the record's key: the name in metrics.jsonl, TensorBoard and the trackers
    format: str = ".4f"  # how the value is written (a format spec)

    def shown(self, record: dict) -> str | None:
        """The value as the line writes it, or None when the record does not hold a number for it."""
        value = record.get(self.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        return format(value, self.format)


def shown_fields(fields: list[LineField], record: dict) -> dict[str, str]:
    """{name: value as written} of the fields the record holds, in the fields' order."""
    shown = {}
    for field in fields:
        value = field.shown(record)
        if value is not None:
            shown[field.name] = value
    return shown
