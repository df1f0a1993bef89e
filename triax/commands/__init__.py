"""The `triax` commands: one module per command, each owning its parser and `main(argv) -> int`
and calling the library (as Accelerate's `commands/`). `cli.py` routes a command line to them;
nothing in the library imports this package."""
