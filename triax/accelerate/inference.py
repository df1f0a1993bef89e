"""accelerate.inference's counterpart. PiPPy pipeline inference is not part of triax: its names
import, and using one raises a line naming triax.pipe.Pipe, triax's pipeline."""

from triax.accelerate._internal.surface import serve_absent

__all__: list[str] = []

__getattr__, __dir__ = serve_absent(__name__)
