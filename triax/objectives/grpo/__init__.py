"""GRPO (data.task=grpo, grpo.*): Group Relative Policy Optimization as TRL 1.16's GRPOTrainer
defines it, with its DAPO, Dr. GRPO, BNPO and GSPO variants (docs/grpo.md). Its modules: config
(the keys), prompts, rewards and scoring, generation, logprobs, loss and metrics, rollout,
objective (the rollout and the loss behind triax.objectives' interface), build (for `triax train`)."""
