"""Evaluation: which validation windows are scored (`windows.py`) and `triax eval` (`command.py`)."""
