"""Hostile and careless input, fourth pass, through the real CLI: chat templates as untrusted code
(bounded in work and in what they build, as they build it), chat records checked as text, exports
and reports that never replace a file triax did not write, numeric options with a range, PEFT
adapters checked tensor by tensor against the model, Slurm's node list in ASCII digits, and
messages that name the option, file or variable the user gave.

Every case: one line, exit code 2, nothing written anywhere (the sandbox of support/sandbox.py
lists the whole tree before and after), within seconds.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from support.chat_files import (CONVERSATIONS, LLAMA3_SPECIAL, LLAMA3_TEMPLATE, arithmetic_conversations,
                                write_chat_checkpoint, write_chat_file, write_tokenizer)
from support.sandbox import sandbox  # noqa: F401  (the fixture)
from triax.commands.cli import main as triax_main
from support import REPO_DIR

ROOT = REPO_DIR
TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory, LLAMA3_SPECIAL)
    return (directory / "tokenizer.json").read_bytes()


def checkpoint_with(sandbox, tokenizer_json, template):  # noqa: F811
    """A tokenizer directory in the sandbox whose tokenizer_config.json carries `template`."""
    directory = sandbox.work / "checkpoint"
    directory.mkdir(exist_ok=True)
    (directory / "tokenizer.json").write_bytes(tokenizer_json)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **TOKENS}))
    return directory


def tokenize(directory, data, *extra):
    return ["tokenize", "--chat", str(directory), str(data), "--out", "tokens", *extra]


def quickly(sandbox, argv, *words, seconds=20.0):  # noqa: F811
    start = time.monotonic()
    line = sandbox.refused(argv, *words)
    assert time.monotonic() - start < seconds, f"refused only after {time.monotonic() - start:.1f} s: {line}"
    return line


# ---- chat templates: bounded work and sizes ------------------------------------------------------

TEMPLATE_CASES = {
    # the cases
    "huge power": ("{{ 10 ** (10 ** 10) }}", ["bits"]),
    "nested loops printing nothing": (
        "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}", ["operations"]),
    "a gigabyte of 'a'": ("{{ 'a' * 10**9 }}", ["1000000000 times"]),
    "tojson indent bomb": ("{{ messages | tojson(indent=100000000) }}", ["100000000"]),
    "tojson of a doubling list": (
        "{% set ns = namespace(x=[1]) %}{% for i in range(24) %}{% set ns.x = [ns.x, ns.x] %}{% endfor %}"
        "{{ ns.x | tojson(indent=2) }}", ["characters"]),
    "nested generation blocks": ("{% for m in messages %}{% generation %}{{ m['content'] }}{% generation %}x"
                                 "{% endgeneration %}{% endgeneration %}{% endfor %}", ["inside another one"]),
    "generation inside a macro called in generation": (
        "{% macro g() %}{% generation %}x{% endgeneration %}{% endmacro %}"
        "{% for m in messages %}{% generation %}{{ m['content'] }}{{ g() }}{% endgeneration %}{% endfor %}",
        ["inside another one"]),
    "no end of turn": ("{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}"
                       "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}",
                       ["end-of-turn", "never learn to stop"]),
    "no end of turn, no generation tags": ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                                           "{% if add_generation_prompt %}{% endif %}", ["end-of-turn"]),
    # the probe's own
    "str.format width": ("{{ '{:>999999999}'.format(1) }}", ["width"]),
    "%-format width": ("{{ '%0999999999d' % 1 }}", ["width"]),
    "ljust": ("{{ 'a'.ljust(999999999) }}", ["999999999"]),
    "center filter": ("{{ 'a' | center(999999999) }}", ["999999999"]),
    "replace amplifies": ("{% set s = 'a' * 100000 %}{{ s.replace('a', 'b' * 1000) }}", ["characters"]),
    "indent amplifies": ("{% set s = 'a\\n' * 1000000 %}{{ s | indent(100) }}", ["characters"]),
    "join amplifies": ("{% set s = 'a' * 1000000 %}{{ s.join(['x'] * 10000) }}", ["characters"]),
    "list of references printed": ("{% set s = 'a' * 1000000 %}{% set l = [s] * 1000 %}{{ l }}", ["times"]),
    "concatenation doubling": ("{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                               "{% endfor %}{{ ns.s }}", ["characters"]),
    "exponential macro recursion": ("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                                    "{% endmacro %}{{ f(60) }}", ["operations"]),
    "a macro's loop of long text": ("{% macro m() %}{% for i in range(99999) %}{{ big }}{% endfor %}{% endmacro %}"
                                    "{% set big = 'a' * 100000 %}{{ m() }}", ["characters"]),
    "a set block's loop": ("{% set s = 'a' * 100000 %}{% set x %}{% for i in range(99999) %}{{ s }}{% endfor %}"
                           "{% endset %}{{ x }}", ["characters"]),
    "a body of many outputs looped": ("{% for i in range(99999) %}" + "{{ 1 }}" * 2000 + "{% endfor %}",
                                      ["operations"]),
    "str.translate": ("{{ 'a'.translate({97: 'b' * 100000}) }}", ["str.translate"]),
    "str.expandtabs through getitem": ("{{ ('\\t' * 1000)['expandtabs'](100000) }}", ["expandtabs"]),
    "lipsum": ("{{ lipsum(100000, max=100000) }}", ["lipsum"]),
    "recursive loop of exponential size": ("{% for x in messages recursive %}{% if loop.depth < 30 %}"
                                           "{{ loop(messages) }}{% endif %}{% endfor %}", ["operations"]),
    "integer squaring": ("{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
                         "{% endfor %}{{ ns.x }}", ["bits"]),
}


@pytest.mark.parametrize("name", list(TEMPLATE_CASES))
def test_a_hostile_template_is_refused_in_bounded_time(name, sandbox, tokenizer_json):  # noqa: F811
    template, words = TEMPLATE_CASES[name]
    directory = checkpoint_with(sandbox, tokenizer_json, template)
    data = write_chat_file(sandbox.work / "chat.jsonl")
    quickly(sandbox, tokenize(directory, data), str(directory), *words)


def test_real_templates_still_render(sandbox, tokenizer_json, capsys):  # noqa: F811
    """The bounds cost a real template nothing: the Llama 3 style template tokenizes as before."""
    directory = checkpoint_with(sandbox, tokenizer_json, LLAMA3_TEMPLATE)
    data = write_chat_file(sandbox.work / "chat.jsonl", repeat=4)
    assert triax_main(tokenize(directory, data)) == 0


@pytest.mark.multiprocess
def test_template_bombs_stay_within_bounded_memory(tmp_path, tokenizer_json):
    """The issue's four bombs, in a fresh process whose peak memory is measured: each is refused
    long before it could allocate its gigabytes (before the fix: 1 GB and 1.3 GB)."""
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes(tokenizer_json)
    data = write_chat_file(tmp_path / "chat.jsonl")
    bombs = [TEMPLATE_CASES[name][0] for name in ("huge power", "nested loops printing nothing", "a gigabyte of 'a'",
                                                  "tojson indent bomb", "tojson of a doubling list")]
    script = textwrap.dedent(f"""
        import json, resource, sys
        from triax.commands.cli import main
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for number, template in enumerate({bombs!r}):
            config = {{"chat_template": template, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}}
            open({str(directory / "tokenizer_config.json")!r}, "w").write(json.dumps(config))
            assert main(["tokenize", "--chat", {str(directory)!r}, {str(data)!r}, "--out", "out" + str(number)]) == 2
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    grown_mib = int(result.stdout.split()[-1])
    assert grown_mib < 400, f"the refusals grew the process by {grown_mib} MiB"


# ---- chat records: text before the tokenizer ---------------------------------------------------

RECORD_CASES = {
    "lone surrogate": ('{"messages": [{"role": "user", "content": "hi \\ud800"}, '
                       '{"role": "assistant", "content": "x"}]}', ["lone surrogate", "messages[0].content"]),
    "lone surrogate in a completion": ('{"prompt": "q", "completion": "\\udfff"}', ["lone surrogate", "'completion'"]),
    "messages and prompt/completion": ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", '
                                       '"content": "a"}], "prompt": "q2", "completion": "a2"}',
                                       ["'messages' and 'prompt/completion'"]),
    "prompt and instruction": ('{"prompt": "q", "completion": "a", "instruction": "i", "output": "o"}',
                               ["'prompt/completion' and 'instruction/output'"]),
}


@pytest.mark.parametrize("name", list(RECORD_CASES))
def test_a_bad_record_is_refused_before_the_tokenizer(name, sandbox, tokenizer_json):  # noqa: F811
    line, words = RECORD_CASES[name]
    directory = checkpoint_with(sandbox, tokenizer_json, LLAMA3_TEMPLATE)
    data = sandbox.work / "chat.jsonl"
    data.write_text(json.dumps(CONVERSATIONS[0]) + "\n" + line + "\n")
    quickly(sandbox, tokenize(directory, data), f"{data}:2", *words)


def test_a_symlinked_chat_file_names_its_target(sandbox, tokenizer_json):  # noqa: F811
    directory = checkpoint_with(sandbox, tokenizer_json, LLAMA3_TEMPLATE)
    data = write_chat_file(sandbox.work / "chat.jsonl")
    os.symlink(data, sandbox.work / "link.jsonl")
    line = quickly(sandbox, tokenize(directory, "link.jsonl"), "is a symlink", str(data))
    assert "run or output directory" not in line


# ---- chat runs: a LoRA run, and the files the user named ---------------------------------------

@pytest.fixture(scope="module")
def chat_base(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat-base") / "base"
    write_chat_checkpoint(directory)
    chat = write_chat_file(directory.parent / "chat.jsonl", arithmetic_conversations(24, seed=1))
    return directory, chat


def chat_overrides(run_dir, base, chat, **extra):
    values = {"model.init_from": base, "data.task": "chat", "data.path": chat, "data.block_size": 64,
              "model.lora.rank": 4, "model.lora.alpha": 8, "model.lora.targets": "[all-linear]",
              "trainer.max_steps": 2, "trainer.batch_size": 4, "trainer.eval_every": 0, "trainer.sample_tokens": 0,
              "trainer.run_dir": run_dir, **extra}
    return ["train", *[f"{key}={value}" for key, value in values.items()]]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, chat_base):
    base, chat = chat_base
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    assert triax_main(chat_overrides(run_dir, base, chat)) == 0
    return run_dir


@pytest.fixture
def lora_copy(lora_run, sandbox):  # noqa: F811
    return shutil.copytree(lora_run, sandbox.work / "lora")


def test_data_val_path_is_named_as_itself(sandbox, chat_base):  # noqa: F811
    base, chat = chat_base
    bad = sandbox.work / "val.jsonl"
    bad.write_text('{"prompt": "q"}\n')
    line = quickly(sandbox, chat_overrides(sandbox.work / "run", base, chat, **{"data.val_path": bad}),
                   f"{bad}:1", "'completion'")
    missing = quickly(sandbox, chat_overrides(sandbox.work / "run", base, chat,
                                              **{"data.val_path": sandbox.work / "none.jsonl"}), "data.val_path")
    assert "data.path" not in missing and line


def test_eval_chat_names_its_option(sandbox, chat_base):  # noqa: F811
    base, _ = chat_base
    line = quickly(sandbox, ["eval", str(base), "--chat", "missing.jsonl"], "--chat 'missing.jsonl'")
    assert "data.path" not in line


@pytest.mark.parametrize("argv", [["export", "{run}", "out", "--format", "nanogpt"],
                                  ["export", "{run}", "out.safetensors"],
                                  ["generate", "{run}", "--prompt", "hi"]])
def test_a_lora_run_read_as_a_whole_model_says_how_to_export_it(argv, sandbox, lora_copy):  # noqa: F811
    argv = [arg.format(run=lora_copy) for arg in argv]
    line = quickly(sandbox, argv, "LoRA run", "--format hf --merge")
    assert "damaged" not in line


def test_a_lora_run_as_init_from_says_how_to_export_it(sandbox, lora_copy, chat_base):  # noqa: F811
    _, chat = chat_base
    quickly(sandbox, chat_overrides(sandbox.work / "run2", lora_copy, chat), "LoRA run", "--format hf --merge")


# ---- exports and reports: the kept-directory rule --------------------------------------------------

def test_peft_export_never_replaces_a_foreign_adapter(sandbox, lora_copy, capsys):  # noqa: F811
    out = sandbox.work / "adapter"
    out.mkdir()
    (out / "adapter_config.json").write_text('{"mine": true}')
    quickly(sandbox, ["export", str(lora_copy), str(out), "--format", "peft"], "adapter_config.json", "--force")
    (out / "adapter_config.json").unlink()
    os.symlink(sandbox.work / "elsewhere.safetensors", out / "adapter_model.safetensors")
    quickly(sandbox, ["export", str(lora_copy), str(out), "--format", "peft"], "adapter_model.safetensors")
    os.unlink(out / "adapter_model.safetensors")
    # Its own export it replaces; a foreign one with --force.
    assert triax_main(["export", str(lora_copy), str(out), "--format", "peft"]) == 0
    assert triax_main(["export", str(lora_copy), str(out), "--format", "peft"]) == 0
    (out / "adapter_config.json").write_text('{"mine": true}')
    (out / "adapter_model.safetensors").write_bytes(b"foreign")
    quickly(sandbox, ["export", str(lora_copy), str(out), "--format", "peft"], "adapter_model.safetensors")
    assert triax_main(["export", str(lora_copy), str(out), "--format", "peft", "--force"]) == 0
    # A directory where a file goes: refused before any file is written, --force or not.
    (out / "adapter_config.json").unlink()
    (out / "adapter_config.json").mkdir()
    quickly(sandbox, ["export", str(lora_copy), str(out), "--format", "peft", "--force"], "a directory named")


@pytest.fixture(scope="module")
def nanogpt_run(tmp_path_factory):
    """A tiny run nanoGPT's GPT can hold (exact GELU)."""
    from support.helpers import tiny_overrides

    root = tmp_path_factory.mktemp("nanogpt-run")
    corpus = root / "corpus.txt"
    corpus.write_text("ab cd ef gh " * 400)
    run_dir = root / "run"
    assert triax_main(["train", *tiny_overrides(run_dir, corpus, **{"trainer.max_steps": 2, "model.gelu": "exact",
                                                                     "model.tie_embeddings": True})]) == 0
    return run_dir


def test_nanogpt_export_never_replaces_a_foreign_ckpt(sandbox, nanogpt_run):  # noqa: F811
    run_copy = shutil.copytree(nanogpt_run, sandbox.work / "run")
    out = sandbox.work / "nanogpt"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"someone's checkpoint")
    quickly(sandbox, ["export", str(run_copy), str(out), "--format", "nanogpt"], "ckpt.pt", "--force")
    (out / "ckpt.pt").unlink()
    os.symlink(sandbox.work / "target.pt", out / "ckpt.pt")
    quickly(sandbox, ["export", str(run_copy), str(out), "--format", "nanogpt"], "ckpt.pt")
    os.unlink(out / "ckpt.pt")
    assert triax_main(["export", str(run_copy), str(out), "--format", "nanogpt"]) == 0
    assert triax_main(["export", str(run_copy), str(out), "--format", "nanogpt"]) == 0  # its own: replaced
    torch.save({"model": {}}, out / "ckpt.pt")
    quickly(sandbox, ["export", str(run_copy), str(out), "--format", "nanogpt"], "ckpt.pt")
    assert triax_main(["export", str(run_copy), str(out), "--format", "nanogpt", "--force"]) == 0


def test_gpu_suite_report_never_replaces_a_foreign_file_or_a_link(sandbox):  # noqa: F811
    (sandbox.work / "report.json").write_text('{"mine": true}')
    quickly(sandbox, ["doctor", "--gpu-suite", "--json", "report.json"], "--json 'report.json'", "--force")
    os.symlink(sandbox.root / "home" / "target.json", sandbox.work / "link.json")
    quickly(sandbox, ["doctor", "--gpu-suite", "--json", "link.json"], "--json 'link.json'")
    quickly(sandbox, ["doctor", "--gpu-suite", "--budget", "nan"], "--budget")


# ---- numeric options ---------------------------------------------------------------------------

@pytest.mark.parametrize("option, value", [("--seconds", "1e12"), ("--seconds", "inf"), ("--seconds", "nan"),
                                           ("--seconds", "0"), ("--store-timeout", "1e12"),
                                           ("--link-mib", "1e9"), ("--sizes", "1,1e12"),
                                           ("--sizes", "1e-9"), ("--link-mib", "1e-9"), ("--seconds", "1e-300"),
                                           ("--store-timeout", "1e-300")])
def test_every_numeric_doctor_option_has_a_range(option, value, sandbox):  # noqa: F811
    quickly(sandbox, ["doctor", option, value], option)


# ---- SLURM_JOB_NODELIST -------------------------------------------------------------------------

@pytest.mark.parametrize("nodelist", ["n[\u0661-\u0662]", "n[1-\u0662]", "n\u0661", "n[\uff11-\uff12]"])
def test_a_node_list_with_other_digits_is_refused(nodelist, sandbox, monkeypatch):  # noqa: F811
    from triax.errors import TriaxError
    from triax.runtime.slurm import expand_nodelist

    with pytest.raises(TriaxError) as caught:
        expand_nodelist(nodelist, "SLURM_JOB_NODELIST")
    assert "SLURM_JOB_NODELIST" in str(caught.value) and "\n" not in str(caught.value)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", nodelist)
    quickly(sandbox, ["horovodrun", "-np", "2", "python", "-c", "pass"], "SLURM_JOB_NODELIST")


def test_too_many_slurm_slots_name_the_variable(sandbox, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-9]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "100000(x9)")
    line = quickly(sandbox, ["horovodrun", "-np", "2", "python", "-c", "pass"], "SLURM_JOB_NODELIST")
    assert "-H" not in line


# ---- PEFT adapters: checked against the model, tensor by tensor -----------------------------------

def _exported_adapter(sandbox, lora_copy):  # noqa: F811
    out = sandbox.work / "adapter"
    assert triax_main(["export", str(lora_copy), str(out), "--format", "peft"]) == 0
    return out


def _edit_tensors(directory, change):
    from safetensors.torch import load_file, save_file

    path = directory / "adapter_model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _first(tensors, suffix="lora_A.weight"):
    return next(name for name in sorted(tensors) if name.endswith(suffix))


ADAPTER_CASES = {
    "alpha_pattern": (lambda d: _edit_config(d, alpha_pattern={"q_proj": 64}), ["alpha_pattern", "per-layer"]),
    "rank_pattern": (lambda d: _edit_config(d, rank_pattern={"q_proj": 2}), ["rank_pattern"]),
    "layers_to_transform": (lambda d: _edit_config(d, layers_to_transform=[0]), ["layers_to_transform"]),
    "modules_to_save": (lambda d: _edit_config(d, modules_to_save=["lm_head"]), ["modules_to_save"]),
    "bias": (lambda d: _edit_config(d, bias="all"), ["bias='all'"]),
    "NaN values": (lambda d: _edit_tensors(d, lambda t: t[_first(t)].fill_(float("nan"))), ["NaN or infinite"]),
    "inf values": (lambda d: _edit_tensors(d, lambda t: t[_first(t, "lora_B.weight")].fill_(float("inf"))),
                   ["NaN or infinite"]),
    "int32 tensor": (lambda d: _edit_tensors(d, lambda t: t.update({_first(t): t[_first(t)].to(torch.int32)})),
                     ["I32", "floating-point"]),
    "a layer the model lacks": (lambda d: _edit_tensors(d, lambda t: t.update(
        {_first(t).replace("layers.0.", "layers.99."): t[_first(t)].clone()})), ["layers.99."]),
    "a shape the model lacks": (lambda d: _edit_tensors(d, lambda t: t.update({_first(t): torch.zeros(4, 3)})),
                                ["shape [4, 3]"]),
    "weights linked outside": (lambda d: _link_outside(d, "adapter_model.safetensors"), ["links outside"]),
    "config linked outside": (lambda d: _link_outside(d, "adapter_config.json"), ["links outside"]),
    "weights missing": (lambda d: os.remove(d / "adapter_model.safetensors"), ["cannot be read (No such file"]),
    "weights a directory": (lambda d: (os.remove(d / "adapter_model.safetensors"),
                                       os.mkdir(d / "adapter_model.safetensors")), ["is not a regular file"]),
}


def _edit_config(directory, **changes):
    path = directory / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _link_outside(directory, name):
    target = directory.parent / f"outside-{name}"
    shutil.move(directory / name, target)
    os.symlink(target, directory / name)


@pytest.mark.parametrize("name", list(ADAPTER_CASES))
def test_a_bad_adapter_is_refused_in_one_line(name, sandbox, lora_copy, chat_base):  # noqa: F811
    base, chat = chat_base
    adapter = _exported_adapter(sandbox, lora_copy)
    change, words = ADAPTER_CASES[name]
    change(adapter)
    quickly(sandbox, chat_overrides(sandbox.work / "run", base, chat, **{"model.lora.init_from": adapter}),
            "model.lora.init_from", *words)


def test_an_adapter_that_overflows_the_loss_stops_the_run(sandbox, lora_copy, chat_base, capsys):  # noqa: F811
    """lora_B of 1e30 is finite and loads; the loss it gives is not: the run stops in one line, exit 2,
    having saved nothing of that state (no snapshot, no logged NaN)."""
    base, chat = chat_base
    adapter = _exported_adapter(sandbox, lora_copy)
    _edit_tensors(adapter, lambda t: [t[name].fill_(1e30) for name in t if name.endswith("lora_B.weight")])
    run_dir = sandbox.work / "run"
    capsys.readouterr()
    assert triax_main(chat_overrides(run_dir, base, chat, **{"model.lora.init_from": adapter})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stopped being finite at step 1" in err[0] and "no snapshot was written" in err[0], err
    assert not list((run_dir / "snapshots").glob("step_*"))


def test_peft_applies_alpha_pattern_so_refusing_it_is_needed(sandbox, lora_copy, chat_base):  # noqa: F811
    """PEFT itself scales a layer named in alpha_pattern by its own alpha: an adapter with one is a
    different model from the one triax would build, hence the refusal above."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base, _ = chat_base
    adapter = _exported_adapter(sandbox, lora_copy)
    _edit_config(adapter, alpha_pattern={"q_proj": 64})
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), str(adapter))
    scalings = {module.scaling["default"] for name, module in model.named_modules()
                if hasattr(module, "scaling") and name.endswith("q_proj")}
    assert scalings == {64 / 4}


# ---- the abort at exit after a Parquet refusal ------------------------------------------------------

@pytest.mark.multiprocess
def test_reading_parquet_starts_no_thread_that_calls_back_into_python(tmp_path):
    """The cause of the abort at exit (`terminate called without an active exception`, exit 134,
    intermittent) after a refused Parquet record: Arrow given a Python file object reads it on its
    I/O threads, which call back into Python; one still doing so while the interpreter shuts down
    aborts the process. The reader gives Arrow the bytes and reads on the calling thread, so no
    Arrow thread is ever started (jemalloc's background thread never enters Python). Checked in a
    fresh process, deterministically: the threads before and after reading a file with a bad row."""
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    records = [CONVERSATIONS[0]] * 50 + [{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}]
    rows = pyarrow.RecordBatch.from_struct_array(pyarrow.array(records))
    parquet.write_table(pyarrow.Table.from_batches([rows]), tmp_path / "chat.parquet")
    script = textwrap.dedent(f"""
        import os
        import pyarrow.parquet
        from triax.data.chat import RecordError, read_records, record_messages

        def threads():
            return {{task: open(f"/proc/self/task/{{task}}/comm").read().strip() for task in os.listdir("/proc/self/task")}}

        before = threads()
        try:
            for where, record in read_records({str(tmp_path / "chat.parquet")!r}):
                record_messages(record, where)
        except RecordError as error:
            print("refused:", error)
        started = {{task: name for task, name in threads().items() if task not in before}}
        print(sorted(name for name in started.values() if name != "jemalloc_bg_thd"))
    """)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("refused:") and "row 50" in lines[0]
    assert lines[-1] == "[]", f"reading Parquet started threads: {lines[-1]}"


@pytest.mark.parametrize("device", ["bogus", "cuda:99", "meta"])
def test_gpu_suite_device_is_checked(device, sandbox):  # noqa: F811
    if device != "bogus" and torch.cuda.is_available() and torch.cuda.device_count() > 99:
        pytest.skip("a machine with 100 GPUs")
    quickly(sandbox, ["doctor", "--gpu-suite", "--device", device], "--device")


# ---- Slurm variables read as options --------------------------------------------------------------

@pytest.mark.parametrize("port", ["\u0661\u0662\u0663\u0664", "99999", "0", "http"])
def test_master_port_is_checked_like_an_option(port):
    from triax.errors import TriaxError
    from triax.runtime.slurm import launch_placement

    env = {"SLURM_STEP_ID": "0", "SLURM_NODEID": "0", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "MASTER_PORT": port}
    with pytest.raises(TriaxError, match="MASTER_PORT"):
        launch_placement(env)


def test_a_node_id_in_other_digits_is_not_a_node():
    from triax.errors import TriaxError
    from triax.runtime.slurm import launch_placement, local_world_size

    env = {"SLURM_STEP_ID": "0", "SLURM_NODEID": "\u0661", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    with pytest.raises(TriaxError, match="SLURM_NODEID"):
        launch_placement(env)
    assert local_world_size(env) is None


# ---- files of other tools: the message names the file and what is wrong ------------------------

def test_a_meta_plain_pickle_names_the_global_and_never_runs(sandbox):  # noqa: F811
    import pickle

    folder = sandbox.work / "meta"
    folder.mkdir()
    (folder / "params.json").write_text(json.dumps({"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                                    "vocab_size": 300, "multiple_of": 16, "norm_eps": 1e-5}))
    (folder / "tokenizer.model").write_bytes(b"not read")
    marker = sandbox.root / "home" / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (folder / "consolidated.00.pth").write_bytes(pickle.dumps({"tok_embeddings.weight": Payload()}))
    corpus = sandbox.work / "corpus.txt"
    corpus.write_text("ab cd " * 200)
    quickly(sandbox, ["train", f"model.init_from={folder}", f"data.path={corpus}", "trainer.max_steps=1",
                      f"trainer.run_dir={sandbox.work / 'run'}"], "consolidated.00.pth", "posix.system")
    assert not marker.exists()


def test_a_bad_scheduler_bin_is_named_as_such(tmp_path):
    from support.accelerator_checkpoints import prepared
    from triax.checkpoint import SnapshotCorruptError
    from triax.interop.shared.pickled import pickled_bytes

    accelerator, model, optimizer, scheduler, counter, _ = prepared()
    folder = accelerator.save_state(str(tmp_path / "ckpt"))
    os.remove(os.path.join(folder, "triax_manifest.json"))
    with open(os.path.join(folder, "scheduler.bin"), "wb") as handle:
        handle.write(pickled_bytes({**scheduler.state_dict(), "last_epoch": "abc"}))
    with pytest.raises(SnapshotCorruptError) as raised:
        accelerator.load_state(folder)
    assert "scheduler.bin" in str(raised.value) and "state.json" not in str(raised.value)
