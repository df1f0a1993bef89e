"""accelerate.hooks' counterpart. The forward hooks of big-model inference (device alignment, CPU
offload) are not part of triax: their names import, and using one raises a line naming the
alternative (shard with FSDP, or split the model into stages with triax.pipe.Pipe)."""

from triax.accelerate._internal.surface import serve_absent

__all__: list[str] = []

__getattr__, __dir__ = serve_absent(__name__)
