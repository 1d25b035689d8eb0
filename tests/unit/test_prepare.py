"""``meshtrain data prepare`` with a tokenizer trained here (the ``tokenizers`` library is the reference)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from meshtrain.api.spec import training as api_training
from meshtrain.cli import main
from meshtrain.trainer.data import dataset, prepare

TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "a tensor parallel group stays inside one node",
    "pipeline stages spread over the fabric",
]


def _bpe(path, vocab_size=300):
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TEXT * 20, trainer=trainer)
    tokenizer.save(str(path))
    return tokenizer


def test_text_and_jsonl_become_the_tokenizers_ids_with_end_of_text(tmp_path, capsys):
    tokenizer = _bpe(tmp_path / "tokenizer.json")
    (tmp_path / "a.txt").write_text(TEXT[0])
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXT[1:]) + "\n")
    out = tmp_path / "tokens.bin"
    code = main.main(
        [
            "data",
            "prepare",
            str(tmp_path / "a.txt"),
            str(tmp_path / "b.jsonl"),
            "--tokenizer",
            str(tmp_path / "tokenizer.json"),
            "-o",
            str(out),
            "--model-vocab",
            "512",
        ]
    )
    assert code == 0, capsys.readouterr().err
    eos = tokenizer.token_to_id("<|endoftext|>")
    expected = [i for t in TEXT for i in tokenizer.encode(t, add_special_tokens=False).ids + [eos]]
    assert np.fromfile(out, dtype="<u2").tolist() == expected
    meta = json.loads((tmp_path / "tokens.bin.json").read_text())
    assert meta["dtype"] == "uint16" and meta["tokens"] == len(expected)
    assert meta["documents"] == len(TEXT) == expected.count(eos)  # tokens / documents
    lengths = [len(tokenizer.encode(t, add_special_tokens=False).ids) + 1 for t in TEXT]
    assert sum(lengths) == len(expected)
    weighted = sum(d * d for d in lengths) / sum(lengths)  # training.documentLength
    assert meta["attention_length"] == pytest.approx(weighted, abs=0.05)
    assert meta["vocab"] == tokenizer.get_vocab_size()
    training = api_training.Training(
        dataset=str(out)
    )  # the file trains: every id checked, metadata agrees
    files = dataset.open_dataset(training, vocab=512, seq_len=4)
    assert len(files[0].tokens) == len(expected)


def test_tokenizer_larger_than_the_model_is_refused(tmp_path, capsys):
    _bpe(tmp_path / "tokenizer.json")
    (tmp_path / "a.txt").write_text(TEXT[0])
    code = main.main(
        [
            "data",
            "prepare",
            str(tmp_path / "a.txt"),
            "--tokenizer",
            str(tmp_path / "tokenizer.json"),
            "-o",
            str(tmp_path / "t.bin"),
            "--model-vocab",
            "256",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "exceeds the model's spec.model.vocab=256" in err
    assert str(tmp_path / "tokenizer.json") in err and not (tmp_path / "t.bin").exists()


def test_uint16_output_for_a_vocabulary_above_65535_is_refused(tmp_path, capsys):
    words = {f"w{i}": i for i in range(70_000)}
    big = Tokenizer(models.WordLevel(vocab={**words, "[UNK]": 70_000}, unk_token="[UNK]"))
    big.pre_tokenizer = pre_tokenizers.Whitespace()
    big.save(str(tmp_path / "big.json"))
    (tmp_path / "a.txt").write_text("w1 w69999 w5")
    args = ["data", "prepare", str(tmp_path / "a.txt"), "--tokenizer", str(tmp_path / "big.json")]
    assert main.main([*args, "-o", str(tmp_path / "t16.bin"), "--dtype", "uint16"]) == 2
    assert "do not fit in uint16" in capsys.readouterr().err
    assert main.main([*args, "-o", str(tmp_path / "t32.bin")]) == 0  # auto picks uint32
    assert np.fromfile(tmp_path / "t32.bin", dtype="<u4").tolist() == [1, 69_999, 5]
    with pytest.raises(dataset.DatasetError, match="set spec.training.tokenDtype: uint32"):
        dataset.open_dataset(
            api_training.Training(dataset=str(tmp_path / "t32.bin")), vocab=70_001, seq_len=1
        )


def _with_template(path, single, specials, *, byte_level_post=False):
    """A BPE tokenizer trained here whose post-processor adds ``single``'s special tokens (Llama style),
    or (``byte_level_post``) GPT-2's ByteLevel post-processor, which adds none."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", *specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TEXT * 20, trainer=trainer)
    if byte_level_post:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=[(t, tokenizer.token_to_id(t)) for t in specials]
        )
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize(
    ("name", "single", "specials", "byte_level_post", "starts_with_bos"),
    [
        ("llama3", "<|begin_of_text|> $A", ["<|begin_of_text|>", "<|end_of_text|>"], False, True),
        ("llama2", "<s> $A", ["<s>", "</s>"], False, True),
        ("bos-and-eos", "<s> $A </s>", ["<s>", "</s>"], False, True),
        ("gpt2", "", ["<|endoftext|>"], True, False),
        ("own-bos-name", "<|startoftext|> $A", ["<|startoftext|>", "<|endoftext|>"], False, True),
    ],
)
def test_documents_get_the_special_tokens_transformers_adds_then_end_of_text(
    tmp_path, name, single, specials, byte_level_post, starts_with_bos
):
    path = _with_template(
        tmp_path / f"{name}.json", single, specials, byte_level_post=byte_level_post
    )
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXT) + "\n")
    out = tmp_path / "t.bin"
    meta = prepare.prepare([tmp_path / "docs.jsonl"], path, out, progress=False)
    peer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    eos = peer.convert_tokens_to_ids(specials[-1])
    expected = []
    for text in TEXT:  # transformers' encoding of a document, then end-of-text once
        ids = peer(text)["input_ids"]  # add_special_tokens=True, as transformers encodes by default
        expected += ids if ids[-1] == eos else [*ids, eos]
    assert np.fromfile(out, dtype="<u2").tolist() == expected
    first = peer(TEXT[0])["input_ids"][0]
    assert (first == peer.convert_tokens_to_ids(specials[0])) == starts_with_bos
    assert meta["bos_per_document"] == starts_with_bos and meta["eos_per_document"]
    assert (meta["bos_id"], meta["eos_id"]) == (peer.convert_tokens_to_ids(specials[0]), eos)
    assert expected.count(eos) == len(TEXT)  # never doubled when the template ends with it


def test_truncation_and_padding_saved_in_the_tokenizer_are_not_applied(tmp_path):
    tokenizer = _bpe(tmp_path / "plain.json")
    eos = tokenizer.token_to_id("<|endoftext|>")
    expected = [i for t in TEXT for i in tokenizer.encode(t).ids + [eos]]
    tokenizer.enable_truncation(max_length=3)
    tokenizer.enable_padding(length=64, pad_id=0, pad_token="<unk>")
    tokenizer.save(str(tmp_path / "saved.json"))
    assert (
        Tokenizer.from_file(str(tmp_path / "saved.json")).truncation is not None
    )  # what from_file restores
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXT) + "\n")
    prepare.prepare(
        [tmp_path / "docs.jsonl"], tmp_path / "saved.json", tmp_path / "t.bin", progress=False
    )
    assert np.fromfile(tmp_path / "t.bin", dtype="<u2").tolist() == expected


def test_vocabulary_is_the_largest_id_plus_one_for_sparse_ids(tmp_path):
    sparse = Tokenizer(models.WordLevel(vocab={"a": 0, "[UNK]": 1, "b": 9}, unk_token="[UNK]"))
    sparse.pre_tokenizer = pre_tokenizers.Whitespace()
    sparse.save(str(tmp_path / "sparse.json"))
    (tmp_path / "a.txt").write_text("a b")
    with pytest.raises(prepare.PrepareError, match="vocabulary of 10 tokens exceeds"):
        prepare.prepare(
            [tmp_path / "a.txt"], tmp_path / "sparse.json", tmp_path / "t.bin", model_vocab=9
        )
    meta = prepare.prepare(
        [tmp_path / "a.txt"], tmp_path / "sparse.json", tmp_path / "t.bin", progress=False
    )
    assert meta["vocab"] > max(np.fromfile(tmp_path / "t.bin", dtype="<u2").tolist())


def test_a_non_string_text_value_names_the_line(tmp_path):
    _bpe(tmp_path / "tokenizer.json")
    (tmp_path / "d.jsonl").write_text(
        json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": 5}) + "\n"
    )
    with pytest.raises(
        prepare.PrepareError, match=r"d\.jsonl:2: not a JSON object with a 'text' string"
    ):
        prepare.prepare(
            [tmp_path / "d.jsonl"], tmp_path / "tokenizer.json", tmp_path / "t.bin", progress=False
        )


def test_data_of_another_tokenizer_than_the_other_source_or_the_model_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT[0])
    llama2 = _with_template(tmp_path / "l2.json", "<s> $A", ["<s>", "</s>"])
    gpt2 = _bpe(tmp_path / "gpt2.json")
    prepare.prepare([tmp_path / "a.txt"], llama2, tmp_path / "a.bin", progress=False)
    prepare.prepare(
        [tmp_path / "a.txt"], tmp_path / "gpt2.json", tmp_path / "b.bin", progress=False
    )
    mixture = api_training.Training.model_validate(
        {"datasets": [{"path": str(tmp_path / "a.bin")}, {"path": str(tmp_path / "b.bin")}]}
    )
    with pytest.raises(
        dataset.DatasetError, match="a.bin.json and .*b.bin.json were prepared with different"
    ):
        dataset.check_dataset(mixture, vocab=512)
    # the model directory names the ids transformers gives the llama2-style tokenizer's <s> and </s>
    peer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(llama2), bos_token="<s>", eos_token="</s>"
    )
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    config = {"bos_token_id": peer.bos_token_id, "eos_token_id": peer.eos_token_id}
    (model_dir / "config.json").write_text(json.dumps(config))
    one = api_training.Training(dataset=str(tmp_path / "a.bin"))
    dataset.check_dataset(
        one, vocab=512, from_hf=str(model_dir)
    )  # the model's own tokenizer: accepted
    other = api_training.Training(dataset=str(tmp_path / "b.bin"))
    want = rf"b.bin.json: eos_id={gpt2.token_to_id('<|endoftext|>')} but .*config.json eos_token_id"
    with pytest.raises(dataset.DatasetError, match=want):
        dataset.check_dataset(other, vocab=512, from_hf=str(model_dir))
    (model_dir / "config.json").write_text(
        json.dumps({**config, "bos_token_id": peer.eos_token_id})
    )
    with pytest.raises(
        dataset.DatasetError, match=r"a.bin.json: bos_id=.* but .*config.json bos_token_id"
    ):
        dataset.check_dataset(one, vocab=512, from_hf=str(model_dir))
