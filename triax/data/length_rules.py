"""What a record longer than its budget becomes: a chat conversation past `data.block_size`
(OVERLONG_RULES) and a preference pair past `data.max_length` (TRUNCATION_MODES, TRL's names).

A leaf without torch, so that `triax tokenize`'s parser can offer these choices without importing
the readers that apply them (torch costs the command a second of start-up)."""

OVERLONG_RULES = ("truncate", "drop")
TRUNCATION_MODES = ("keep_start", "keep_end")
