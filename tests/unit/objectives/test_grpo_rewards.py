"""Reward functions: loaded from a file, a module or the built-ins; called with TRL's arguments;
and every way user code can fail (raises, hangs, wrong count, not a number, NaN) stops with one
line naming the function and the record. Hostile files (links, FIFOs, syntax errors) likewise."""

import math
import os
import threading

import pytest
import torch

from triax.errors import TriaxError
from triax.objectives.grpo.rewards import (RewardConfigError, RewardFailure, exact_match, final_answer,
                                           format_reward, load_reward, load_rewards)
from triax.objectives.grpo.scoring import score

PLACES = ["p.jsonl:1", "p.jsonl:1", "p.jsonl:2", "p.jsonl:2"]
COMPLETIONS = ["12", "#### 7", "<answer>3</answer>", r"so \boxed{5}"]


def write(tmp_path, body: str, name: str = "rewards.py") -> str:
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def run(function, completions=COMPLETIONS, places=PLACES, timeout=5.0, **columns):
    reward = load_reward(function) if isinstance(function, str) else function
    return score([reward], ["q"] * len(completions), completions, [[1]] * len(completions),
                 {key: list(value) for key, value in columns.items()}, places, timeout)


def test_a_file_function_gets_trl_arguments_and_the_records_columns(tmp_path):
    path = write(tmp_path, "seen = {}\n"
                 "def length(prompts, completions, completion_ids, answer, **kwargs):\n"
                 "    seen.update(kwargs, answer=answer, ids=completion_ids)\n"
                 "    return [len(c) for c in completions]\n")
    reward = load_reward(f"{path}:length")
    table = run(reward, answer=["12", "7", "3", "5"], level=[1, 1, 2, 2])
    assert reward.name == "length"
    assert table[:, 0].tolist() == [2.0, 6.0, 18.0, 12.0]
    module_seen = reward.function.__globals__["seen"]
    assert module_seen["answer"] == ["12", "7", "3", "5"] and module_seen["level"] == [1, 1, 2, 2]


def test_a_module_function_and_none_for_unscored(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def half(prompts, completions, **kw):\n"
                                            "    return [None if i % 2 else 0.5 for i in range(len(completions))]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    table = run("my_rewards:half")
    assert table[0, 0] == 0.5 and math.isnan(table[1, 0]) and table.dtype == torch.float32


def test_built_in_exact_match_reads_the_final_answer():
    assert final_answer(r"the sum is \boxed{ 42 }") == "42"
    assert final_answer("<think>x</think><answer> 7 </answer>") == "7"
    assert final_answer("work\n#### 1,000") == "1,000"
    assert final_answer(" 579\n") == "579"
    scores = exact_match([], COMPLETIONS + [[{"role": "assistant", "content": "9"}]], ["12", "7", "4", 5, 9])
    assert scores == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert exact_match([], ["1"], [None]) == [None]


def test_built_in_format_check():
    good = ["<think>a</think>\n<answer>1</answer>", "<answer>2</answer>\n"]
    bad = ["<answer>1</answer> more", "<think>a</think>", "1", "<answer>1</answer><answer>2</answer>"]
    assert format_reward([], good + bad) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_exact_match_without_an_answer_column_is_one_line():
    with pytest.raises(RewardFailure, match="needs an `answer` field"):
        run("exact_match")


def test_two_functions_of_one_name_log_apart(tmp_path):
    path = write(tmp_path, "def score(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    assert [reward.name for reward in load_rewards([f"{path}:score", "format", f"{path}:score"])] == [
        "score_1", "format", "score_2"]


FAILING = {
    "raises": ("    raise KeyError('no answer here')", r"'bad' raised KeyError: 'no answer here' scoring the "
               r"completions of records p.jsonl:1, p.jsonl:2"),
    "wrong count": ("    return [1.0]", r"'bad' returned 1 rewards for 4 completions \(of records p.jsonl:1"),
    "not a list": ("    return 1.0", r"'bad' returned a float scoring"),
    "a string": ("    return [1.0, 1.0, 'high', 1.0]", r"'bad' returned 'high' \(str\) for the completion of record "
                 r"p.jsonl:2"),
    "NaN": ("    return [1.0, float('nan'), 0.0, 0.0]", r"'bad' returned nan for the completion of record p.jsonl:1"),
    "infinity": ("    return [0.0, 0.0, 0.0, float('-inf')]", r"returned -inf for the completion of record p.jsonl:2"),
    "a hang": ("    while True: pass", r"'bad' ran past grpo.reward_timeout=0.3 s scoring the completions of records"),
    "a sleep": ("    import time; time.sleep(3600)", r"ran past grpo.reward_timeout=0.3 s"),
    "exits": ("    raise SystemExit(3)", r"'bad' raised SystemExit: 3"),
}


@pytest.mark.parametrize("case", sorted(FAILING))
def test_a_failing_reward_is_one_line_naming_it_and_the_record(tmp_path, case):
    body, message = FAILING[case]
    path = write(tmp_path, f"def bad(prompts, completions, **kwargs):\n{body}\n")
    with pytest.raises(RewardFailure, match=message) as caught:
        run(f"{path}:bad", timeout=0.3)
    assert isinstance(caught.value, TriaxError) and isinstance(caught.value, RuntimeError)
    assert "\n" not in str(caught.value)


def test_a_hang_off_the_main_thread_is_stopped_too(tmp_path):
    path = write(tmp_path, "def bad(prompts, completions, **kwargs):\n    import time; time.sleep(3600)\n")
    caught = []

    def worker():
        try:
            run(f"{path}:bad", timeout=0.3)
        except RewardFailure as error:
            caught.append(str(error))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert caught and "ran past grpo.reward_timeout=0.3 s" in caught[0]


def test_the_alarm_is_put_back_after_a_call(tmp_path):
    import signal
    before = signal.getsignal(signal.SIGALRM)
    run(load_reward(write(tmp_path, "def ok(prompts, completions, **kw):\n    return [0] * len(completions)\n") + ":ok"))
    assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def hostile_specs(tmp_path):
    good = write(tmp_path, "def ok(prompts, completions, **kw):\n    return [0] * len(completions)\nvalue = 3\n")
    os.symlink(good, tmp_path / "link.py")
    os.mkfifo(tmp_path / "fifo.py")
    (tmp_path / "folder.py").mkdir()
    write(tmp_path, "def broken(:\n", "syntax.py")
    write(tmp_path, "raise RuntimeError('import-time failure')\n", "raising.py")
    write(tmp_path, "x = 1\n", "text.txt")
    (tmp_path / "latin.py").write_bytes(b"# caf\xe9\n")
    return {
        f"{tmp_path}/missing.py:ok": "does not exist",
        f"{tmp_path}/link.py:ok": "symlink",
        f"{tmp_path}/fifo.py:ok": "not a regular file",
        f"{tmp_path}/folder.py:ok": "cannot be read",
        f"{tmp_path}/syntax.py:broken": "raised SyntaxError",
        f"{tmp_path}/raising.py:ok": "raised RuntimeError: import-time failure",
        f"{tmp_path}/text.txt:ok": "is not a .py file",
        f"{tmp_path}/latin.py:ok": "cannot be read",
        f"{good}:nothing": "has no function 'nothing'",
        f"{good}:value": "has no function 'value' (it is a int)",
        "no_such_module_here:ok": "importing 'no_such_module_here' raised ModuleNotFoundError",
        "exact": "neither a built-in reward",
        "module:": "neither a built-in reward",
        ":ok": "neither a built-in reward",
        "module:not-a-name": "neither a built-in reward",
    }


def test_hostile_reward_names_and_files_are_one_line(tmp_path):
    for spec, message in hostile_specs(tmp_path).items():
        with pytest.raises(RewardConfigError) as caught:
            load_reward(spec)
        assert message in str(caught.value), (spec, str(caught.value))
        assert str(caught.value).startswith("grpo.reward_funcs: ") and "\n" not in str(caught.value)
        assert isinstance(caught.value, ValueError)
