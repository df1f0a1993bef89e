"""accelerate.big_modeling's counterpart. Big-model inference (device maps, CPU/disk offload,
dispatch hooks, empty-weight initialisation) is not part of triax: its names import, and using one
raises a line naming the alternative (FSDP, triax.pipe.Pipe, or `with torch.device('meta'):`)."""

from triax.accelerate._internal.surface import serve_absent

__all__: list[str] = []

__getattr__, __dir__ = serve_absent(__name__)
