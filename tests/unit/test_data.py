import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from diloco.config import TrainConfig
from diloco.data.batches import ShardSampler, ShardSet, eval_windows
from diloco.data.formats import Document
from diloco.data.recipe import training_corpus
from diloco.data.shards import KMEANS_UNIT_TOKENS, genre_groups, kmeans_units, make_shards, plan_shards
from diloco.data.text import load_corpus
from diloco.data.tokenizer import ByteTokenizer
from diloco.data.tokens import TRAIN, TUNE, VAL, pieces, tail_cut
from diloco.errors import UserError


def _corpus():
    return training_corpus(TrainConfig(), ByteTokenizer(), False)


def _shards(k, kind, seed=0):
    corpus = _corpus()
    return make_shards(corpus, plan_shards(corpus, k, kind=kind, seed=seed, decode=ByteTokenizer().decode))


def test_corpus_is_bundled_whole():
    works = load_corpus()
    assert len(works) == 42
    assert {w.genre for w in works} == {"comedy", "tragedy", "history", "poetry", "romance"}
    assert sum(len(w.text) for w in works) == 5_057_198


def test_tokenizer_round_trips():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode_batch(["To be, or not to be"])[0]) == "To be, or not to be"


def test_validation_is_the_last_five_percent_of_every_work_and_never_trained_on():
    works = load_corpus()
    val = _corpus().split(True)
    assert len(val) == sum(int(len(w.text) * 0.05) for w in works)
    for kind in ("genre", "kmeans"):
        shards, _ = _shards(4, kind)
        assert sum(len(s) for s in shards) + len(val) == sum(len(w.text) for w in works)
    train, held = tail_cut(works[0].text.decode(), 0.05)
    assert (train + held).encode() == works[0].text
    assert len(held) == int(len(works[0].text) * 0.05)
    assert bytes(val.numpy()[: len(held)].tolist()) == held.encode()  # the first work's tail comes first


def test_a_tuning_split_is_the_end_of_every_training_text_and_leaves_validation_as_it_was():
    """--tune-fraction 0.1: each work is its training head, then a tuning tail of a tenth of
    what it trained on before, then the validation tail as before; the shards skip the tuning
    text, validation stays the same tokens, and --eval-on tune scores the tuning text."""
    from diloco.data.recipe import validation

    works = load_corpus()
    plain = TrainConfig()
    cfg = dataclasses.replace(plain, data=dataclasses.replace(plain.data, tune_fraction=0.1))
    corpus, before = training_corpus(cfg, ByteTokenizer(), False), _corpus()
    assert np.array_equal(corpus.split(VAL).numpy(), before.split(VAL).numpy())
    train, _ = tail_cut(works[0].text.decode(), 0.05)
    _, tune = tail_cut(train, 0.1)
    assert len(tune) == int(len(train.encode()) * 0.1)
    assert bytes(corpus.split(TUNE).numpy()[: len(tune)].tolist()) == tune.encode()  # the first work's
    assert len(corpus.split(TUNE)) == sum(int(len(tail_cut(w.text.decode(), 0.05)[0]) * 0.1) for w in works)
    assert len(corpus.split(TRAIN)) + len(corpus.split(TUNE)) == len(before.split(TRAIN))
    shards, _ = make_shards(corpus, plan_shards(corpus, 2, kind="genre", seed=0))
    assert sum(len(s) for s in shards) == len(corpus.split(TRAIN))  # genre shards: every training token
    assert np.array_equal(validation(cfg, ByteTokenizer(), False).numpy(), before.split(VAL).numpy())
    tuned = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_on="tune"))
    assert np.array_equal(validation(tuned, ByteTokenizer(), False).numpy(), corpus.split(TUNE).numpy())


def test_a_tuning_split_of_whole_documents_takes_the_tail_of_each_training_document():
    docs = [Document("a" * 100, "x"), Document("b" * 50, "y")]
    got = list(pieces(docs, val_fraction=0.5, whole=True, held=[0, 1], tune_fraction=0.2))
    assert [(p.text, p.val, p.ends_document) for p in got] == [
        ("a" * 80, TRAIN, False),
        ("a" * 20, TUNE, True),
        ("b" * 50, VAL, True),
    ]
    plain = list(pieces(docs, val_fraction=0.5, whole=True, held=[0, 1]))
    assert [(p.text, p.val) for p in plain] == [("a" * 100, TRAIN), ("b" * 50, VAL)]


@pytest.mark.parametrize("kind", ["genre", "kmeans", "by-source"])
def test_non_iid_weights_follow_shard_tokens_and_sum_to_one(kind):
    shards, weights = _shards(4, kind)
    total = sum(len(s) for s in shards)
    assert weights == pytest.approx([len(s) / total for s in shards])
    assert sum(weights) == pytest.approx(1.0)
    assert len(set(round(w, 6) for w in weights)) > 1  # really unequal


def test_iid_shards_are_equal_and_weighted_equally():
    shards, weights = _shards(3, "iid")
    assert len({len(s) for s in shards}) == 1
    assert weights == [1 / 3] * 3


def test_genre_shards_keep_genres_apart_and_are_deterministic():
    works = load_corpus()
    groups = genre_groups(works, 5)
    assert sorted({works[i].genre for i in g}.pop() for g in groups) == sorted(
        {"comedy", "tragedy", "history", "poetry", "romance"}
    )
    for k in (3, 8):
        groups = genre_groups(works, k)
        assert len(groups) == k and all(groups)
        assert sorted(i for g in groups for i in g) == list(range(42))
        assert groups == genre_groups(works, k)
    assert all(len({works[i].genre for i in g}) == 1 for g in genre_groups(works, 8))


def test_genre_shards_feed_every_worker_up_to_one_work_each():
    # Up to 36 workers the genre quotas fit; from 37 a genre got more workers than works and a
    # worker an empty shard. Now every worker reads at least one work of a single genre.
    works = load_corpus()
    for k in range(6, 43):
        groups = genre_groups(works, k)
        assert len(groups) == k and all(groups), k
        assert sorted(i for g in groups for i in g) == list(range(42))
        assert all(len({works[i].genre for i in g}) == 1 for g in groups)
    shards, _ = _shards(42, "genre")  # one work each: its training text (all but the last 5%)
    assert sorted(len(s) for s in shards) == sorted(len(w.text) - int(len(w.text) * 0.05) for w in works)


def test_kmeans_clusters_parts_of_works_into_shards_that_partition_the_training_text():
    stream, units = kmeans_units(_corpus())
    assert units[0][0] == 0 and units[-1][1] == len(stream)
    assert all(u[1] == v[0] for u, v in zip(units, units[1:]))  # they tile the training text
    assert len(units) > 1000 and max(hi - lo for lo, hi in units) < 1.5 * KMEANS_UNIT_TOKENS
    a, _ = _shards(4, "kmeans", seed=0)
    b, _ = _shards(4, "kmeans", seed=0)
    assert all((x.numpy() == y.numpy()).all() for x, y in zip(a, b))
    tokens = np.concatenate([x.numpy() for x in a])
    assert len(tokens) == len(stream)
    assert (np.bincount(tokens, minlength=256) == np.bincount(stream.numpy(), minlength=256)).all()
    # whole works as units gave this seed a shard of one 1,992-token poem, less than one batch
    assert min(len(x) for x in a) > 0.05 * len(stream)


def test_sampler_resumes_exactly_and_rejects_a_tiny_shard():
    tokens = torch.arange(1000, dtype=torch.uint8)
    s = ShardSampler(tokens, batch_size=2, seq_len=8, seed=0)
    next(s)
    state = s.state_dict()
    expected = next(s)
    s2 = ShardSampler(tokens, batch_size=2, seq_len=8, seed=0)
    s2.load_state_dict(state)
    got = next(s2)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(expected[0][:, 1:], expected[1][:, :-1])  # targets are inputs shifted by one
    with pytest.raises(UserError, match="fewer than one batch"):
        ShardSampler(tokens[:10], batch_size=2, seq_len=8, seed=0)


def test_shard_set_seeks_any_shard_position():
    a = ShardSampler(torch.arange(500, dtype=torch.uint8), batch_size=2, seq_len=8, seed=1)
    b = ShardSampler(torch.arange(500, dtype=torch.uint8) + 100, batch_size=2, seq_len=8, seed=2)
    reference = ShardSampler(torch.arange(500, dtype=torch.uint8) + 100, batch_size=2, seq_len=8, seed=2)
    for _ in range(3):
        third = next(reference)
    shards = ShardSet([a, b], current=0)
    next(shards)
    shards.seek(1, 2)
    assert torch.equal(next(shards)[0], third[0])
    assert shards.state_dict() == {"current": 1, "steps": [1, 3]}


def test_eval_windows_subset_is_fixed_and_spread():
    tokens = torch.arange(200, dtype=torch.uint8)
    full = eval_windows(tokens, 9)
    sub = eval_windows(tokens, 9, limit=5)
    assert full.shape == (22, 10) and sub.shape == (5, 10)
    assert torch.equal(sub[0], full[0]) and torch.equal(sub[-1], full[-1])


def _bundled_archive() -> dict[str, bytes]:
    """The files of the corpus archive shipped in the package, read directly (not via load_corpus)."""
    import io
    import lzma
    import tarfile
    from importlib import resources

    blob = resources.files("diloco.data.corpus").joinpath("shakespeare.tar.xz").read_bytes()
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(blob))) as tar:
        return {m.name.removeprefix("./"): tar.extractfile(m).read() for m in tar if m.isfile()}


def test_bundled_manifest_lists_exactly_the_42_works_the_loader_yields():
    files = _bundled_archive()
    manifest = json.loads(files.pop("manifest.json"))
    entries = manifest["works"]
    assert len(entries) == 42
    assert sorted(e["file"] for e in entries) == sorted(files)  # no file missing, none unlisted
    works = load_corpus()
    assert [(e["title"], e["genre"]) for e in entries] == [(w.title, w.genre) for w in works]
    assert [files[e["file"]] for e in entries] == [w.text for w in works]
    assert all(e["chars"] == len(files[e["file"]].decode()) for e in entries)
    counts = {g: sum(e["genre"] == g for e in entries) for g in {e["genre"] for e in entries}}
    assert counts == {"comedy": 12, "tragedy": 11, "history": 10, "poetry": 5, "romance": 4}
    assert (works[0].title, works[-1].title) == ("All's Well That Ends Well", "The Winter's Tale")
    assert "public domain" in manifest["license"].lower()


def test_a_damaged_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("DILOCO_CACHE", str(tmp_path))
    first = _corpus()
    folder = Path(first.file.path).parent
    (folder / "pieces.npz").write_bytes(b"not a zip")
    again = _corpus()  # rebuilt, same tokens
    assert (again.split(True).numpy() == first.split(True).numpy()).all()
    assert len(list(tmp_path.glob("tokens-*"))) == 1 and not list(tmp_path.glob("*.tmp-*"))
