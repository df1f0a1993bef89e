"""The Accelerator's saved state is checked as it is read: dataloader entries are null or objects, and
an infinity it wrote itself is kept, but never in a learning rate or betas. (The Accelerator's
checkpoint folders: numbers out of range, hostile pickles, links and FIFOs are refused in
test_accelerate_folder.py.)"""

import pytest


def test_accelerator_state_dataloader_entries_are_null_or_objects():
    from triax.accelerate._internal.saving import validate_state
    from triax.checkpoint import SnapshotError

    state = {"schedulers": [], "custom": [], "optimizer_steps": [], "stateless_optimizers": [],
             "saved_models": [0], "num_models": 1, "micro_step": 0, "scaler": {}, "units": [[[0], []]],
             "dataloaders": [None, {"_num_yielded": 3}]}
    validate_state(state, "s")
    state["dataloaders"][0] = 5
    with pytest.raises(SnapshotError, match="neither null nor an object"):
        validate_state(state, "s")


def test_accelerator_state_keeps_an_infinity_it_wrote_but_not_in_a_learning_rate():
    import json
    import math

    from triax.accelerate._internal.saving import from_json, to_json
    from triax.checkpoint.numbers import bad_number, finite_float, reject_constant

    plateau = {"best": math.inf, "mode_worse": -math.inf, "last_epoch": 0}
    text = json.dumps(to_json(plateau))
    stored = json.loads(text, parse_constant=reject_constant, parse_float=finite_float)  # strict JSON reads it
    assert from_json(stored) == plateau and bad_number({"schedulers": [stored]}) is None
    assert "base_lrs" in bad_number({"schedulers": [to_json({"base_lrs": [math.nan], "last_epoch": 0})]})
    assert "betas" in bad_number({"optimizer": to_json({"betas": (1.5, 0.999)})})
