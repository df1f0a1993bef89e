"""The run is resolved before the Trainer (triax.train.prepare): the Trainer trains the prepared
config as it is given, and the caller's composed config is never edited."""

import copy

import pytest

from triax.config import compose_config
from triax.errors import ConfigError
from triax.train.prepare import prepare_run
from triax.train.trainer import Trainer

from support.helpers import tiny_overrides

BATCH_PAST_THE_DATA = 4096  # more samples than the tiny corpus holds: lowered to fit


def composed(tmp_path, tiny_corpus, monkeypatch):
    with open(tiny_corpus) as corpus:  # a few thousand samples, fewer than one batch asks for
        (tmp_path / "corpus.txt").write_text(corpus.read()[:3000])
    monkeypatch.chdir(tmp_path)  # data.path as typed is relative: the run makes it absolute
    return compose_config(tiny_overrides("run", "corpus.txt", **{"trainer.max_steps": 2,
                                                                 "trainer.batch_size": BATCH_PAST_THE_DATA}))


def test_the_trainer_trains_the_prepared_config_as_it_is_given(tmp_path, tiny_corpus, monkeypatch):
    config = composed(tmp_path, tiny_corpus, monkeypatch)
    given = copy.deepcopy(config)
    prepared = prepare_run(config)
    assert config == given  # the composed config: untouched by the resolution
    resolved = prepared.config
    assert resolved is not config and resolved.data.path == str(tmp_path / "corpus.txt")
    assert resolved.trainer.batch_size < BATCH_PAST_THE_DATA and "lowered" in prepared.batch_note
    as_prepared = copy.deepcopy(resolved)
    trainer = Trainer(prepared)
    trainer.fit()
    assert trainer.config is resolved and resolved == as_prepared  # trained as given, not edited
    assert trainer.model_config == prepared.model_config and trainer.data is prepared.data
    assert config == given


def test_a_config_given_to_the_trainer_is_prepared_once_the_same_way(tmp_path, tiny_corpus, monkeypatch):
    """`Trainer(config)`, the Python API, trains what `Trainer(prepare_run(config))` trains."""
    config = composed(tmp_path, tiny_corpus, monkeypatch)
    given = copy.deepcopy(config)
    direct = Trainer(config)
    assert config == given
    prepared = Trainer(prepare_run(compose_config(tiny_overrides("again", "corpus.txt", **{
        "trainer.max_steps": 2, "trainer.batch_size": BATCH_PAST_THE_DATA}))))
    assert prepared.config.trainer.batch_size == direct.config.trainer.batch_size
    # A run compared with itself: bitwise.
    assert [prepared.train_step() for _ in range(2)] == [direct.train_step() for _ in range(2)]


def test_a_prepared_run_takes_no_second_continued_run(tmp_path, tiny_corpus, monkeypatch):
    prepared = prepare_run(composed(tmp_path, tiny_corpus, monkeypatch))
    with pytest.raises(ConfigError, match="leave `continued` out"):
        Trainer(prepared, prepared.init_source or object())
