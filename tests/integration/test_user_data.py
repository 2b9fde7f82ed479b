"""A user's own text, tokenizer and model, end to end through `diloco train`, `eval`, `generate`
and `export`: real files of every kind, a real BPE, a tiny Llama built by transformers, and the
exported folder loaded back by transformers' Auto classes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_LLAMA
from safetensors.torch import load_file

from diloco.cli.main import build_parser, main
from diloco.config import TrainConfig, from_dict
from diloco.data import tokens
from diloco.data.recipe import prepare_data, training_corpus
from diloco.data.text import load_corpus
from diloco.data.tokenizer import ByteTokenizer
from diloco.data.tokens import is_val_document
from diloco.run.use import open_run, sample

TINY_GPT = "[model]\nn_layer = 2\nn_head = 2\nd_model = 32\n[inner]\nwarmup_steps = 2\n"
SMALL = ["--seq-len", "32", "--batch-size", "4", "--inner-steps", "4", "--rounds", "2", "--workers", "2"]
SMALL += ["--threads", "1", "--procs", "1", "--no-progress"]


def _docs(n: int = 120, size: int = 2000) -> list[dict]:
    """n documents of about `size` characters from the bundled works, with their genre."""
    out = []
    for w in load_corpus():
        text = w.text.decode()
        for i in range(0, min(len(text), 6 * size), size):
            out.append({"text": text[i : i + size], "genre": w.genre, "id": len(out)})
    return out[:n]


def _jsonl(path: Path, docs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def _train(tmp_path: Path, out: str, *flags: str, gpt_sizes: bool = True) -> Path:
    """A tiny run; `gpt_sizes` shrinks diloco's GPT further than the presets (a config file)."""
    (tmp_path / "tiny.toml").write_text(TINY_GPT if gpt_sizes else "[inner]\nwarmup_steps = 2\n")
    run = tmp_path / out
    assert main(["train", "--config", str(tmp_path / "tiny.toml"), *SMALL, *flags, "--out", str(run)]) == 0
    return run


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.mark.timeout(90)
def test_every_input_kind_trains_and_eval_matches_the_summary(tmp_path, capsys):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _docs(150)
    folder = tmp_path / "data"
    (folder / "plays" / "more").mkdir(parents=True)
    for i, d in enumerate(docs[:20]):
        (folder / "plays" / ("more" if i % 2 else "") / f"doc{i}.txt").write_text(d["text"])
    _jsonl(folder / "a.jsonl", docs[20:50])
    (folder / "b.json").write_text(json.dumps(docs[50:70]))
    pq.write_table(pa.Table.from_pylist(docs[70:100]), folder / "c.parquet")
    with open(folder / "d.csv", "w", newline="") as f:
        import csv

        writer = csv.DictWriter(f, fieldnames=["text", "genre", "id"])
        writer.writeheader()
        writer.writerows(docs[100:120])
    datasets.Dataset.from_list(docs[120:150]).save_to_disk(str(tmp_path / "saved"))
    run = _train(tmp_path, "run", "--data", str(folder), str(tmp_path / "saved"))
    summary = _summary(run)
    capsys.readouterr()
    assert main(["eval", str(run), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["val_loss"] == pytest.approx(summary["val_loss"], abs=1e-9)
    assert result["val_ppl"] == pytest.approx(summary["val_ppl"], rel=1e-9)
    # whole documents held out by the hash of their text, wherever they are: their bytes, cut
    # into 32-token windows
    held = [d["text"] for d in docs if is_val_document(d["text"], 0.05)]
    assert 1 <= len(held) < 20
    assert result["tokens"] == (sum(len(t.encode()) for t in held) - 1) // 32 * 32
    # any other text, with the run's tokenizer
    assert main(["eval", str(run), "--data", str(folder / "a.jsonl"), "--json"]) == 0
    other = json.loads(capsys.readouterr().out)
    assert other["tokens"] == (sum(len(d["text"].encode()) for d in docs[20:50]) - 1) // 32 * 32


@pytest.mark.timeout(60)
def test_the_token_cache_is_reused_and_a_changed_file_is_tokenised_again(tmp_path, monkeypatch):
    data = _jsonl(tmp_path / "d.jsonl", _docs(60))
    built = []
    real_build = tokens._build
    monkeypatch.setattr(
        tokens, "_build", lambda folder, *a, **kw: (built.append(folder), real_build(folder, *a, **kw))
    )
    cfg = from_dict({"data": {"paths": [str(data)], "cache_dir": str(tmp_path / "cache")}, "num_workers": 2})
    first = prepare_data(cfg)
    assert len(built) == 1
    second = prepare_data(cfg)
    assert len(built) == 1  # nothing tokenised again
    assert all((a.numpy() == b.numpy()).all() for a, b in zip(first.shards, second.shards))
    assert isinstance(second.corpus.file.array(), __import__("numpy").memmap)  # read from disk
    data.write_text(data.read_text().replace("the", "thy", 1))  # one word of one document
    prepare_data(cfg)
    assert len(built) == 2
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith("."))
    assert len(entries) == 2 and all(e.startswith("tokens-") for e in entries)


@pytest.mark.timeout(90)
def test_bpe_is_saved_in_the_run_and_a_resumed_run_equals_a_straight_one(tmp_path, capsys):
    data = _jsonl(tmp_path / "d.jsonl", _docs(80))
    flags = ["--data", str(data), "--tokenizer", "bpe:300", "--cache-dir", str(tmp_path / "cache")]
    straight = _train(tmp_path, "straight", *flags)
    assert json.loads((straight / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    assert (
        _summary(straight)["params"] > 0
        and json.loads((straight / "config.json").read_text())["model"]["vocab_size"] == 300
    )
    stopped = _train(tmp_path, "resumed", *flags, "--checkpoint-every", "1", "--stop-after", "1")
    import shutil

    shutil.rmtree(tmp_path / "cache")  # the resumed run must take the run's tokenizer, not retrain
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "x").write_text("")
    original = data.read_text()
    data.write_text(original.replace("the", "thy", 1))  # the text changed under the run: refused
    assert main(["train", "--resume", str(stopped), "--no-progress"]) == 2
    assert "is not what the run trained on" in capsys.readouterr().err
    data.write_text(original)
    assert main(["train", "--resume", str(stopped), "--no-progress"]) == 0
    assert (stopped / "model.safetensors").read_bytes() == (straight / "model.safetensors").read_bytes()
    assert not list((tmp_path / "cache").glob("bpe-*.json"))  # no BPE was trained on resume
    assert json.loads((stopped / "data.json").read_text()) == {
        "text": prepare_data_fingerprint(data),
        "rules": {"val_split": 3},
    }
    # a model trained with one BPE cannot start a run whose BPE (same size, other text) differs
    other = _jsonl(tmp_path / "other.jsonl", _docs(120)[60:])
    init = ["--data", str(other), "--tokenizer", "bpe:300", "--init-from", str(straight)]
    (tmp_path / "tiny.toml").write_text(TINY_GPT)
    code = main(
        ["train", "--config", str(tmp_path / "tiny.toml"), *SMALL, *init, "--out", str(tmp_path / "x")]
    )
    assert code == 2 and "was trained with another tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    # with that run's tokenizer file it starts
    init[3] = str(straight / "tokenizer.json")
    assert (
        main(["train", "--config", str(tmp_path / "tiny.toml"), *SMALL, *init, "--out", str(tmp_path / "y")])
        == 0
    )


def prepare_data_fingerprint(path: Path) -> str:
    from diloco.data import sources

    return sources.fingerprint([path])


@pytest.mark.timeout(60)
def test_validation_rules_and_by_source_shards(tmp_path):
    docs = _docs(100)
    data = _jsonl(tmp_path / "d.jsonl", docs)
    cache = str(tmp_path / "cache")
    cfg = from_dict(
        {"data": {"paths": [str(data)], "cache_dir": cache, "shards": "by-source", "source_field": "genre"}}
    )
    prepared = prepare_data(cfg)
    corpus = prepared.corpus
    val_docs = sorted(set(corpus.doc[corpus.val].tolist()))
    assert val_docs == [i for i, d in enumerate(docs) if is_val_document(d["text"], 0.05)] and val_docs
    # a document added in front moves no training document into validation
    grown = _jsonl(tmp_path / "grown.jsonl", [{"text": "A new first document. " * 50, "genre": "new"}, *docs])
    cfg2 = from_dict({"data": {"paths": [str(grown)], "cache_dir": cache}})
    held2 = prepare_data(cfg2).corpus
    assert [i - 1 for i in sorted(set(held2.doc[held2.val].tolist())) if i > 0] == val_docs
    genres = sorted({d["genre"] for d in docs})
    assert len(prepared.shards) == 4 and corpus.sources == sorted(
        corpus.sources, key=[d["genre"] for d in docs].index
    )
    assert set(genres) == set(corpus.sources)
    for shard in prepared.shards:  # each worker reads one source (fewer sources than workers split)
        text = bytes(shard.numpy().tolist()).decode()
        owners = {d["genre"] for d in docs if d["text"][:200] in text}
        assert len(owners) == 1
    # a few documents (fewer than 1/val_fraction): the end of each is held out, as for the bundled works
    few = _jsonl(tmp_path / "few.jsonl", docs[:5])
    corpus = prepare_data(
        from_dict({"data": {"paths": [str(few)], "cache_dir": cache}, "num_workers": 1})
    ).corpus
    assert corpus.val.sum() == 5 and len(corpus.split(True)) == sum(
        int(len(d["text"]) * 0.05) for d in docs[:5]
    )
    # two documents, one of which the hash picks: not half the text held out, each one's end
    pair = [next(d for d in docs if is_val_document(d["text"], 0.05)), docs[0]]
    assert not is_val_document(docs[0]["text"], 0.05)
    two = _jsonl(tmp_path / "two.jsonl", pair)
    cfg = from_dict({"data": {"paths": [str(two)], "cache_dir": cache}, "num_workers": 1})
    corpus = training_corpus(cfg, ByteTokenizer(), False)
    assert corpus.val.sum() == 2 and len(corpus.split(True)) == sum(int(len(d["text"]) * 0.05) for d in pair)
    # --val-data: all of --data trains, all of --val-data validates
    val = _jsonl(tmp_path / "val.jsonl", docs[:10])
    cfg = from_dict(
        {"data": {"paths": [str(data)], "val_data": [str(val)], "cache_dir": cache}, "num_workers": 2}
    )
    prepared = prepare_data(cfg)
    assert not prepared.corpus.val.any()
    assert prepared.eval_full.tokens_predicted() == (sum(len(d["text"]) for d in docs[:10]) - 1) // 128 * 128


@pytest.mark.timeout(60)
def test_generate_samples_from_the_model_reproducibly(tmp_path, capsys):
    run = _train(tmp_path, "run")
    capsys.readouterr()
    assert (
        main(["generate", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "20", "--temperature", "0"])
        == 0
    )
    greedy = capsys.readouterr().out
    finished = open_run(run)
    ids = list(b"ROMEO:")
    for _ in range(20):  # greedy decoding by hand
        ids.append(int(finished.model.logits(torch.tensor([ids[-32:]]))[0, -1].argmax()))
    assert greedy == bytes(ids).decode(errors="replace") + "\n"
    flags = ["--prompt", "ROMEO:", "--max-new-tokens", "30", "--top-k", "5", "--seed", "3"]
    outs = []
    for _ in range(2):
        assert main(["generate", str(run), *flags]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].startswith("ROMEO:") and outs[0] != greedy
    drawn = sample(finished.model, list(b"ab"), max_new_tokens=50, seq_len=32, top_k=1, seed=9)
    assert drawn == sample(finished.model, list(b"ab"), max_new_tokens=50, seq_len=32, temperature=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_export_loads_in_transformers_with_the_same_logits_and_ids(tmp_path, capsys, model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = _jsonl(tmp_path / "d.jsonl", _docs(60))
    flags = ["--data", str(data), "--tokenizer", "bpe:300"]
    if model == "llama":
        (tmp_path / "llama.json").write_text(json.dumps(TINY_LLAMA))
        flags += ["--model-config", str(tmp_path / "llama.json")]
    run = _train(tmp_path, "run", *flags, gpt_sizes=model == "gpt")
    assert main(["export", str(run), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 0  # <|endoftext|>
    modes = {p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert len(modes) == 1  # model.safetensors like every other file
    finished = open_run(run)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "O Romeo, Romeo! wherefore art thou Romeo?"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == finished.tokenizer.encode_batch([text])[0].tolist()
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, finished.model.logits(x), atol=1e-5)
    assert tok.decode(ids) == text
    # and back in: --init-from the exported folder trains that model from those weights
    init = ["--init-from", str(tmp_path / "hf")]
    again = _train(tmp_path, "again", "--data", str(data), "--tokenizer", "bpe:300", *init, gpt_sizes=False)
    cfg = json.loads((again / "config.json").read_text())
    assert json.loads(cfg["model"]["hf_config"])["model_type"] == ("gpt2" if model == "gpt" else "llama")
    first_eval = next(
        json.loads(x) for x in (again / "metrics.jsonl").read_text().splitlines() if '"eval"' in x
    )
    assert first_eval["val_loss"] == pytest.approx(_summary(run)["final_subset_val_loss"], abs=1e-5)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("method", ["diloco", "async", "single", "dp"])
def test_a_hugging_face_model_trains_with_every_method(tmp_path, method):
    (tmp_path / "llama.json").write_text(json.dumps(TINY_LLAMA))
    data = _jsonl(tmp_path / "d.jsonl", _docs(60))
    flags = ["--data", str(data), "--tokenizer", "bpe:300", "--model-config", str(tmp_path / "llama.json")]
    run = _train(tmp_path, "run", *flags, "--method", method, "--rounds", "3", gpt_sizes=False)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [x["val_loss"] for x in lines if x["kind"] == "eval" and x["split"] == "subset"]
    assert evals[-1] < evals[0]  # it learns
    params = sum(v.numel() for v in load_file(str(run / "model.safetensors")).values())
    assert _summary(run)["params"] == params and params > 20_000


def test_user_data_flags_are_in_train_help():
    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for flag in ("--data", "--text-field", "--val-data", "--val-fraction", "--tokenizer", "--model-config"):
        assert flag in text
    assert TrainConfig().data.tokenizer == "byte" and TrainConfig().data.paths == ()


@pytest.mark.timeout(60)
def test_held_out_documents_feed_no_worker_and_one_picked_document_is_not_all_the_text(tmp_path):
    from diloco.errors import UserError

    cache = str(tmp_path / "cache")
    docs = _docs(400)
    picked = [d for d in docs if is_val_document(d["text"], 0.05)]
    kept = [d for d in docs if not is_val_document(d["text"], 0.05)]
    # a source of one document and one of 20, of which the hash holds out one (1/21 of the text):
    # 20 documents have training text, so 21 by-source workers cannot each get one
    _jsonl(tmp_path / "a.jsonl", kept[:1])
    _jsonl(tmp_path / "b.jsonl", [picked[0], *kept[1:20]])
    paths = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    data = {"paths": paths, "cache_dir": cache, "shards": "by-source", "batch_size": 2}
    cfg = from_dict({"data": data, "num_workers": 20, "model": {"seq_len": 32}})
    shards = prepare_data(cfg).shards
    assert sorted(len(s) for s in shards) == sorted(len(d["text"]) for d in [kept[0], *kept[1:20]])
    with pytest.raises(UserError, match="there are 20 documents with training text for 21 workers"):
        prepare_data(from_dict({"data": data, "num_workers": 21, "model": {"seq_len": 32}}))
    # --val-fraction 0.5 and one document that the hash picks: its end, not all of it, validates
    one = next(d for d in docs if is_val_document(d["text"], 0.5))
    _jsonl(tmp_path / "one.jsonl", [one])
    one_file = {"paths": [str(tmp_path / "one.jsonl")], "cache_dir": cache, "val_fraction": 0.5}
    cfg = from_dict({"data": one_file})
    corpus = training_corpus(cfg, ByteTokenizer(), False)
    assert len(corpus.split(False)) == len(one["text"]) - int(len(one["text"]) * 0.5)


@pytest.mark.timeout(60)
def test_a_run_whose_text_an_older_diloco_cut_differently_is_refused(tmp_path):
    from diloco.data.recipe import check_data, data_record
    from diloco.errors import UserError

    data = _jsonl(tmp_path / "d.jsonl", _docs(40))
    cfg = from_dict({"data": {"paths": [str(data)], "shards": "kmeans"}})
    record = data_record(cfg)
    assert record["rules"] == {"val_split": 3, "kmeans_units": 3}
    run = tmp_path / "run"
    run.mkdir()
    (run / "data.json").write_text(json.dumps(record))
    check_data(run, record)  # the same text and rules
    (run / "data.json").write_text(json.dumps({"text": record["text"]}))  # written before the rules
    with pytest.raises(UserError, match=r"cut its text differently \(kmeans_units, val_split\)"):
        check_data(run, record)
    bundled = from_dict({})
    assert "rules" not in data_record(bundled)  # iid shards of the bundled works: nothing changed


@pytest.mark.timeout(60)
def test_rows_of_mixed_length_whose_hash_picks_a_short_one_validate_on_about_val_fraction(tmp_path):
    """91 parquet rows (~280 K characters, 200 to 6,000 each) of which the hash picks one short
    row: whole documents would validate on 0.01% of the text (shorter than one window at the
    default --seq-len), so the end of every row is held out instead, 5% of the text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    line = "to be or not to be, that is the question. "
    rows = [f"row {i}: " + line * (5 + i * 37 % 140) for i in range(200)]
    rows = [t for t in rows if not is_val_document(t, 0.05)][:90]
    rows.insert(40, next(t for j in range(1000) if is_val_document(t := f"short row {j}.", 0.05)))
    pq.write_table(pa.Table.from_pylist([{"text": t} for t in rows]), tmp_path / "d.parquet")
    data = {"paths": [str(tmp_path / "d.parquet")], "cache_dir": str(tmp_path / "cache")}
    prepared = prepare_data(from_dict({"data": data, "num_workers": 2}))  # the default --seq-len
    total = sum(len(t) for t in rows)
    val = len(prepared.corpus.split(True))
    assert val == sum(int(len(t) * 0.05) for t in rows) and 0.049 < val / total <= 0.05
    assert len(prepared.eval_full) == (val - 1) // 128  # every window of the split
