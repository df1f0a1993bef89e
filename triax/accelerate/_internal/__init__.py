"""The Accelerator door's own machinery, which Accelerate has no public module for: its errors, the
constructor's options, FSDP plugin reading, save_state / load_state and their folders, batch sharding,
the prepared optimizer and scheduler, nested-data helpers, and the table of Accelerate's names
(surface). Scripts import Accelerate's names from `triax.accelerate`, `triax.accelerate.utils` and the
other modules named as Accelerate's; nothing here is imported by a script."""
