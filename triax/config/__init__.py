"""The training configuration, in one import: the schema (triax.config.schema: the dataclasses, a
docstring under every field), its composition from YAML and the command line (triax.config.compose)
and the checks of its values (triax.config.validate). The YAML it composes (the default run and the
`+experiment=` files) is in triax/conf/.

A room of its own, below the rooms that read a run's config (train, doctor, eval, bench, commands):
it describes, composes and checks the config and imports none of them.

    from triax.config import TrainConfig, compose_config
"""

from triax.config.compose import (absolute_paths, compose_config, compose_run, continuation_overrides, describe_keys,
                                  from_dict, to_dict)
from triax.config.schema import (DERIVED_MODEL_FIELDS, DataConfig, DebugConfig, ModelConfig, OptimConfig,
                                 ParallelConfig, TrainConfig, TrainerConfig, asynchronous_snapshots,
                                 changed_from_preset, field_docs, final_lr, gpt_config, snapshot_every, snapshot_root,
                                 total_steps)
from triax.config.validate import validate

__all__ = ["TrainConfig", "ModelConfig", "DataConfig", "OptimConfig", "TrainerConfig", "ParallelConfig",
           "DebugConfig", "DERIVED_MODEL_FIELDS", "field_docs", "gpt_config", "final_lr", "snapshot_every",
           "asynchronous_snapshots", "snapshot_root", "total_steps", "changed_from_preset", "absolute_paths",
           "compose_config", "compose_run", "continuation_overrides", "describe_keys", "from_dict", "to_dict",
           "validate"]
