"""A `triax train` run's directory, apart from the training loop: written while the run lives
(`directory.py`: created, locked by `lock.py`, its small files and the copies of a transformers
model.init_from's description), and read back once it has snapshots (`files.py`: model.json and
the text codec checked before anything is allocated; `reader.py`: the snapshot root, the newest good
snapshot, the model, a run as another run starts from it, the places inside a run a command must
not write to; `output_place.py`: the rule for a command's output place; `whole_model.py`: the model `triax eval` scores; `export.py`: the run `triax export` writes;
`chat_generate.py`: `triax generate --chat`).

Imports nothing eagerly: the commands import the one module they need after their arguments are
checked, so `triax --help` stays fast."""
