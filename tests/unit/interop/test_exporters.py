"""triax/interop/exporters.py: `triax export`'s formats are one table of writers of one form,
which the command looks up once."""

from __future__ import annotations

import inspect

from triax.commands import export as export_command
from triax.interop.exporters import EXPORTERS


def test_every_format_the_command_offers_has_a_writer_and_nothing_else():
    assert tuple(EXPORTERS) == export_command.FORMATS


def test_every_writer_takes_the_run_the_output_and_the_options():
    for name, writer in EXPORTERS.items():
        assert list(inspect.signature(writer).parameters)[1:] in (["output", "options"], ["out_dir", "options"]), name
        assert len(inspect.signature(writer).parameters) == 3, name


def test_the_command_does_not_switch_on_the_format():
    source = inspect.getsource(export_command.main)
    assert "args.format ==" not in source and "args.merge" in source
