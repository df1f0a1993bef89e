"""accelerate.parallelism_config's counterpart. ParallelismConfig (tensor, context and data
parallel sizes for the Accelerator) is not part of triax: it imports, and using it raises a line
naming `triax train`'s layouts, where triax composes those parallelisms."""

from triax.accelerate._internal.surface import serve_absent

__all__: list[str] = []

__getattr__, __dir__ = serve_absent(__name__)
