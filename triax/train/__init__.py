from triax.config import TrainConfig, compose_config
from triax.train.trainer import Trainer

__all__ = ["TrainConfig", "Trainer", "compose_config"]
