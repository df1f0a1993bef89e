"""MkDocs hook: fills docs/accelerate.md's table of Accelerate's names (same / differs, how /
absent, what instead), module by module, from triax.accelerate._internal.surface and the counterpart
modules' __all__ at build time, so the page cannot drift from the code."""

from __future__ import annotations

MARKER = "<!-- accelerate-names -->"


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != "accelerate.md":
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/accelerate.md lost its {MARKER} line; put it back where the table goes")
    from triax.accelerate._internal.surface import markdown_table

    return markdown.replace(MARKER, markdown_table())
