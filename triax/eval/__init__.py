"""Evaluation: what `triax eval` (triax.commands.eval) scores (`scoring.py`, over the windows of
triax.data.windows) and a DPO run's preference scores (`preference_eval.py`)."""
