"""A `checkpoint-N` folder written by transformers' Trainer (two real training steps of a tiny
GPT-2) is a `model.init_from` source as it is: triax computes the trained model's logits from it."""

import pytest
import torch

from support.gpt2_checkpoints import VOCAB, build_gpt2

transformers = pytest.importorskip("transformers")


def test_a_trainer_checkpoint_folder_starts_a_triax_model_with_its_weights(tmp_path, tiny_corpus):
    from triax.interop.hf.whole_model import load_hf_model
    from triax.train import init_from

    model = build_gpt2(tmp_path / "base", tiny_corpus, tie=True).train()
    ids = torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(0))
    samples = [{"input_ids": row, "labels": row} for row in ids]
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, save_steps=2,
                                               per_device_train_batch_size=4, use_cpu=True, report_to=[],
                                               learning_rate=1e-2)
    transformers.Trainer(model=model, args=arguments, train_dataset=samples).train()
    folder = tmp_path / "out" / "checkpoint-2"
    assert (folder / "optimizer.pt").is_file() and (folder / "trainer_state.json").is_file()

    source = init_from.resolve(str(folder))
    assert source.kind == "transformers" and source.architecture["n_layer"] == 2
    ours = load_hf_model(str(folder), torch.device("cpu"))
    model.eval()
    with torch.no_grad():
        assert torch.allclose(ours(ids[:2]), model(ids[:2]).logits, atol=1e-5, rtol=1e-5)
