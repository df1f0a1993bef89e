"""triax: distributed training for GPT-style and any PyTorch model."""

from triax.version import __version__


def __getattr__(name):
    # Doors are imported lazily so `import triax` stays cheap and `triax.horovod` users
    # do not pay for the trainer.
    if name == "Accelerator":
        from triax.accelerate import Accelerator

        return Accelerator
    raise AttributeError(f"module 'triax' has no attribute {name!r}")
