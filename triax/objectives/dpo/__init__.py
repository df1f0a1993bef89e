"""DPO (data.task=preference, dpo.*): Direct Preference Optimization as TRL 1.16's DPOTrainer defines
it, with its sigmoid, ipo, hinge and robust losses (docs/preference.md). Its modules: config (the
keys and their checks), loss (answer log-probabilities, each pair's loss and metrics), objective
(behind triax.objectives' interface), build (its pairs and the objective, for `triax train`)."""
