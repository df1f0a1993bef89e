"""The training configuration, in one import: the schema (triax.train.schema: the dataclasses, a
docstring under every field), its composition from YAML and the command line (triax.train.compose)
and the checks of its values (triax.train.validate).

    from triax.train.config import TrainConfig, compose_config
"""

from triax.train.compose import (absolute_paths, compose_config, continuation_overrides, describe_keys, from_dict,
                                 to_dict)
from triax.train.schema import (DERIVED_MODEL_FIELDS, DataConfig, DebugConfig, ModelConfig, OptimConfig,
                                ParallelConfig, TrainConfig, TrainerConfig, asynchronous_snapshots,
                                changed_from_preset, field_docs, final_lr, gpt_config, snapshot_every, snapshot_root,
                                total_steps)
from triax.train.validate import validate

__all__ = ["TrainConfig", "ModelConfig", "DataConfig", "OptimConfig", "TrainerConfig", "ParallelConfig",
           "DebugConfig", "DERIVED_MODEL_FIELDS", "field_docs", "gpt_config", "final_lr", "snapshot_every",
           "asynchronous_snapshots", "snapshot_root", "total_steps", "changed_from_preset", "absolute_paths",
           "compose_config", "continuation_overrides", "describe_keys", "from_dict", "to_dict", "validate"]
