"""triax's version, in a module of its own: code that needs it at run time (a snapshot's manifest)
imports it when it is loaded, never later. An attribute of the `triax` package itself could be
missing by then: with an editable install, a folder named `triax` in the working directory (a
checkout's parent) makes `triax` a namespace package whose submodules still load."""

__version__ = "0.1.0"
