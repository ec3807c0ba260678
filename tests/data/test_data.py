"""Corpora: token counts on the real files, checksums, error messages, data root, caches, tokenizer."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
from helpers import GET_BOTH, REAL_DATA, REAL_PTB, needs_real_data, needs_real_ptb, real_data_root
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from localclip.data import corpora
from localclip.data.corpora import (
    CORPORA,
    EOS,
    Vocabulary,
    corpus_path,
    load_corpus,
    load_corpus_from_dir,
    read_tokens,
    resolve_data_root,
    split_lines,
    tokenize_lines,
)
from localclip.errors import DataError, LocalclipError

# The published numbers (shared/data/README.md), written out here rather than read from
# CORPORA so that a wrong constant in the module cannot make its own test pass.
EXPECTED = {
    "ptb": {"train": 929_589, "valid": 73_760, "test": 82_430, "vocab": 10_000},
    "wikitext2": {"train": 2_088_628, "valid": 217_646, "test": 245_569, "vocab": 33_278},
}


@pytest.fixture(scope="module", params=["ptb", "wikitext2"])
def real_corpus(request):
    """Each real corpus in turn; a test on one skips only when that corpus is missing."""
    root = real_data_root(request.param)
    if root is None:
        pytest.skip(f"needs the real {request.param} corpus: {GET_BOTH}")
    return load_corpus(request.param, root)


def _copy_corpus(name: str, dest_root: Path) -> Path:
    folder = dest_root / CORPORA[name].folder
    folder.mkdir(parents=True)
    for split in ("train", "valid", "test"):
        shutil.copyfile(real_data_root(name) / CORPORA[name].folder / f"{split}.txt", folder / f"{split}.txt")
    return folder


# ---------------------------------------------------------------------------------------------
# The real corpora
# ---------------------------------------------------------------------------------------------


def test_error_types_are_user_errors():
    assert issubclass(DataError, LocalclipError)


def test_known_corpora_constants_match_published_numbers():
    for name, exp in EXPECTED.items():
        spec = CORPORA[name]
        assert spec.num_tokens == {s: exp[s] for s in ("train", "valid", "test")}
        assert spec.vocab_size == exp["vocab"]
        assert set(spec.sha256) == {"train.txt", "valid.txt", "test.txt"}


@pytest.mark.full  # the real corpora
def test_token_counts_and_vocab_size(real_corpus):
    exp = EXPECTED[real_corpus.name]
    for split in ("train", "valid", "test"):
        ids = real_corpus.split(split)
        assert ids.dtype == torch.long and ids.dim() == 1
        assert ids.numel() == exp[split], split
        assert 0 <= int(ids.min()) and int(ids.max()) < exp["vocab"]
    assert len(real_corpus.vocab) == exp["vocab"]
    # Both published vocabularies are the train vocabularies: valid and test add no word.
    assert torch.unique(real_corpus.train).numel() == exp["vocab"]
    assert real_corpus.sha256 == CORPORA[real_corpus.name].sha256


@pytest.mark.full  # the real corpora
def test_ids_follow_first_appearance_over_train_valid_test(real_corpus):
    stream = torch.cat([real_corpus.train, real_corpus.valid, real_corpus.test]).tolist()
    first_seen = list(dict.fromkeys(stream))
    assert first_seen == list(range(len(real_corpus.vocab)))
    v = real_corpus.vocab
    assert all(v.word2idx[w] == i for i, w in enumerate(v.idx2word))
    assert EOS in v


@pytest.mark.full  # the real corpora
def test_ids_decode_back_to_the_text(real_corpus):
    tokens = read_tokens(real_corpus.path / "valid.txt")
    assert real_corpus.vocab.decode(real_corpus.valid) == tokens


@needs_real_data
def test_every_line_ends_with_eos_including_empty_ones():
    # WikiText-2's blank lines carry an <eos> too: that is what makes 2,088,628 train tokens.
    c = load_corpus("wikitext2", REAL_DATA)
    n_lines = len(split_lines((REAL_DATA / "wikitext2" / "train.txt").read_text(encoding="utf-8")))
    assert n_lines == 36_718
    assert int((c.train == c.vocab.word2idx[EOS]).sum()) == n_lines


@needs_real_ptb
def test_loads_are_deterministic_and_do_not_share_state():
    a = load_corpus("ptb", REAL_PTB)
    b = load_corpus("ptb", REAL_PTB)
    assert torch.equal(a.train, b.train) and a.vocab.idx2word == b.vocab.idx2word
    a.train[0] = 12345
    a.vocab.add_word("not-a-ptb-word")
    c = load_corpus("ptb", REAL_PTB)
    assert torch.equal(c.train, b.train)
    assert "not-a-ptb-word" not in c.vocab and len(c.vocab) == 10_000


# ---------------------------------------------------------------------------------------------
# Checksums and errors
# ---------------------------------------------------------------------------------------------


@needs_real_ptb
def test_checksum_mismatch_names_file_hashes_and_the_way_out(tmp_path):
    folder = _copy_corpus("ptb", tmp_path)
    valid = folder / "valid.txt"
    data = bytearray(valid.read_bytes())
    pos = next(i for i in range(1000, len(data)) if chr(data[i]).isalpha())
    data[pos] = ord("x") if data[pos] != ord("x") else ord("y")  # a letter: token count unchanged
    valid.write_bytes(bytes(data))
    actual = corpora._sha256_of(valid)

    with pytest.raises(DataError) as err:
        load_corpus("ptb", tmp_path)
    msg = str(err.value)
    assert str(valid) in msg
    assert CORPORA["ptb"].sha256["valid.txt"] in msg and actual in msg
    assert "allow_custom=True" in msg and "--allow-custom-corpus" in msg

    with pytest.warns(UserWarning, match="valid.txt"):
        custom = load_corpus("ptb", tmp_path, allow_custom=True)
    assert custom.sha256["valid.txt"] == actual
    assert custom.valid.numel() == EXPECTED["ptb"]["valid"]  # one letter changed, not a token count

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unchecked = load_corpus("ptb", tmp_path, verify=False)
    assert torch.equal(unchecked.valid, custom.valid)


def test_missing_corpus_names_the_path_and_the_download_command(tmp_path):
    with pytest.raises(DataError) as err:
        load_corpus("ptb", tmp_path)
    msg = str(err.value)
    assert str(tmp_path / "ptbdataset" / "train.txt") in msg
    assert f"localclip data download ptb --data-root {tmp_path}" in msg


def test_missing_single_split_is_named(tmp_path):
    folder = tmp_path / "wikitext2"
    folder.mkdir()
    for split in ("train", "valid"):
        (folder / f"{split}.txt").write_text("a b\n")
    with pytest.raises(DataError, match=str(folder / "test.txt")):
        load_corpus("wikitext2", tmp_path)


def test_unknown_corpus_lists_known_names():
    with pytest.raises(DataError) as err:
        load_corpus("imdb", "/nonexistent")
    assert "'imdb'" in str(err.value)
    for name in CORPORA:
        assert name in str(err.value)


def test_invalid_utf8_names_the_file(tmp_path):
    bad = tmp_path / "train.txt"
    bad.write_bytes(b"good words\nbad \xff\xfe byte\n")
    with pytest.raises(DataError) as err:
        read_tokens(bad)
    assert str(bad) in str(err.value) and "UTF-8" in str(err.value)


# ---------------------------------------------------------------------------------------------
# Custom corpora
# ---------------------------------------------------------------------------------------------


def _write_small_corpus(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.txt").write_text("the cat sat\n\non the mat\n", encoding="utf-8")
    (folder / "valid.txt").write_text("the dog sat\n", encoding="utf-8")
    (folder / "test.txt").write_text("a bird", encoding="utf-8")  # no final newline: still a line


def test_custom_corpus_from_dir(tmp_path):
    _write_small_corpus(tmp_path / "mine")
    c = load_corpus_from_dir(tmp_path / "mine")
    assert c.name == "mine"
    assert c.vocab.idx2word == ["the", "cat", "sat", EOS, "on", "mat", "dog", "a", "bird"]
    assert c.train.tolist() == [0, 1, 2, 3, 3, 4, 0, 5, 3]
    assert c.valid.tolist() == [0, 6, 2, 3]
    assert c.test.tolist() == [7, 8, 3]


def test_custom_corpus_missing_files_are_named(tmp_path):
    (tmp_path / "train.txt").write_text("x\n")
    with pytest.raises(DataError) as err:
        load_corpus_from_dir(tmp_path)
    assert str(tmp_path / "valid.txt") in str(err.value) and str(tmp_path / "test.txt") in str(err.value)
    with pytest.raises(DataError, match="does not exist"):
        load_corpus_from_dir(tmp_path / "nope")


# ---------------------------------------------------------------------------------------------
# Where the data lives
# ---------------------------------------------------------------------------------------------


def test_data_root_resolution_order(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LOCALCLIP_DATA", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert resolve_data_root() == tmp_path / "home" / ".cache" / "localclip" / "data"

    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # invalid per the XDG spec: ignored
    assert resolve_data_root() == tmp_path / "home" / ".cache" / "localclip" / "data"

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_data_root() == tmp_path / "xdg" / "localclip" / "data"

    monkeypatch.setenv("LOCALCLIP_DATA", str(tmp_path / "env"))
    assert resolve_data_root() == tmp_path / "env"

    assert resolve_data_root(tmp_path / "arg") == tmp_path / "arg"
    assert resolve_data_root(str(tmp_path / "arg")) == tmp_path / "arg"
    assert resolve_data_root("~/d") == tmp_path / "home" / "d"


def test_env_data_root_is_used_by_load_corpus(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCALCLIP_DATA", str(tmp_path))
    with pytest.raises(DataError, match=str(tmp_path / "ptbdataset" / "train.txt")):
        load_corpus("ptb")


def test_corpus_path_accepts_a_root_of_corpora_or_the_corpus_folder(tmp_path):
    assert corpus_path("ptb", tmp_path) == tmp_path / "ptbdataset"  # need not exist
    _write_small_corpus(tmp_path / "ptbdataset")
    assert corpus_path("ptb", tmp_path) == tmp_path / "ptbdataset"
    assert corpus_path("ptb", tmp_path / "ptbdataset") == tmp_path / "ptbdataset"
    # A folder named like another corpus is not taken for this one.
    assert corpus_path("wikitext2", tmp_path / "ptbdataset") == tmp_path / "ptbdataset" / "wikitext2"


@needs_real_ptb
def test_load_from_the_corpus_folder_itself():
    c = load_corpus("ptb", REAL_PTB / "ptbdataset")
    assert c.train.numel() == EXPECTED["ptb"]["train"]


# ---------------------------------------------------------------------------------------------
# Caches
# ---------------------------------------------------------------------------------------------


def _forbid_tokenizing(monkeypatch):
    def boom(files):
        raise AssertionError("tokenized again instead of using the cache")

    monkeypatch.setattr(corpora, "_tokenize_folder", boom)


@pytest.fixture
def empty_memory_cache(monkeypatch):
    # The in-process cache is keyed on content: an identical corpus loaded by another test
    # would otherwise be served from memory and never reach the disk cache.
    monkeypatch.setattr(corpora, "_MEMORY_CACHE", type(corpora._MEMORY_CACHE)())


def test_disk_cache_is_written_atomically_and_reused(tmp_path, monkeypatch, empty_memory_cache):
    _write_small_corpus(tmp_path / "c")
    first = load_corpus_from_dir(tmp_path / "c")
    cache = tmp_path / "c" / corpora._DISK_CACHE_NAME
    assert cache.is_file()
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == sorted(["train.txt", "valid.txt", "test.txt", cache.name])

    monkeypatch.setattr(corpora, "_MEMORY_CACHE", type(corpora._MEMORY_CACHE)())
    _forbid_tokenizing(monkeypatch)
    second = load_corpus_from_dir(tmp_path / "c")
    assert second.vocab.idx2word == first.vocab.idx2word and torch.equal(second.train, first.train)


def test_stale_or_damaged_disk_cache_is_rebuilt(tmp_path, monkeypatch, empty_memory_cache):
    _write_small_corpus(tmp_path / "c")
    load_corpus_from_dir(tmp_path / "c")
    cache = tmp_path / "c" / corpora._DISK_CACHE_NAME

    (tmp_path / "c" / "test.txt").write_text("a different bird\n", encoding="utf-8")
    c = load_corpus_from_dir(tmp_path / "c")
    assert c.vocab.decode(c.test) == ["a", "different", "bird", EOS]

    cache.write_bytes(b"not a torch file")
    monkeypatch.setattr(corpora, "_MEMORY_CACHE", type(corpora._MEMORY_CACHE)())
    c = load_corpus_from_dir(tmp_path / "c")
    assert c.vocab.decode(c.test) == ["a", "different", "bird", EOS]
    assert torch.load(cache, weights_only=True)["idx2word"] == c.vocab.idx2word  # rewritten whole


def test_read_only_folder_skips_disk_cache_silently(tmp_path, empty_memory_cache):
    folder = tmp_path / "ro"
    _write_small_corpus(folder)
    folder.chmod(0o555)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            c = load_corpus_from_dir(folder)
        assert len(c.vocab) == 9
        assert sorted(p.name for p in folder.iterdir()) == ["test.txt", "train.txt", "valid.txt"]
    finally:
        folder.chmod(0o755)


def test_unwritable_cache_is_not_an_error(tmp_path, monkeypatch, empty_memory_cache):
    _write_small_corpus(tmp_path / "c")

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(corpora.tempfile, "mkstemp", refuse)
    c = load_corpus_from_dir(tmp_path / "c")
    assert len(c.vocab) == 9
    assert not (tmp_path / "c" / corpora._DISK_CACHE_NAME).exists()


# ---------------------------------------------------------------------------------------------
# The tokenizer is a pure function of any text
# ---------------------------------------------------------------------------------------------


def test_tokenize_lines_basics():
    assert tokenize_lines([" a  b \n", "\n", "", "c"]) == ["a", "b", EOS, EOS, EOS, "c", EOS]
    assert tokenize_lines([]) == []
    with pytest.raises(TypeError):
        tokenize_lines("a b c")


def test_split_lines_matches_file_iteration_not_str_splitlines():
    text = "a\r\nb\rc\u2028d\x0be\x1cf\n\ng"
    assert split_lines(text) == ["a\n", "b\n", "c\u2028d\x0be\x1cf\n", "\n", "g"]
    # Unicode separators are whitespace inside a line, never extra <eos> tokens.
    assert tokenize_lines(split_lines(text)) == ["a", EOS, "b", EOS, "c", "d", "e", "f", EOS, EOS, "g", EOS]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text()))
def test_tokenize_lines_property(lines):
    tokens = tokenize_lines(lines)
    assert len(tokens) == sum(len(line.split()) + 1 for line in lines)
    assert tokens.count(EOS) >= len(lines)
    assert all(t and not any(ch.isspace() for ch in t) for t in tokens)


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_read_tokens_equals_file_iteration(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("t") / "x.txt"
    path.write_bytes(text.encode("utf-8"))
    with open(path, encoding="utf-8-sig") as f:
        reference = [tok for line in f for tok in line.split() + [EOS]]
    assert read_tokens(path) == reference == tokenize_lines(split_lines(text.removeprefix("\ufeff")))


def test_vocabulary_encode_decode():
    v = Vocabulary.from_words(["x", "y", "x"])
    assert len(v) == 2 and v.idx2word == ["x", "y"]
    assert v.encode(["y", "x"]).tolist() == [1, 0]
    assert v.decode(torch.tensor([[0, 1]])) == ["x", "y"]
    with pytest.raises(KeyError, match="'z'"):
        v.encode(["z"])
    assert v.encode(["z"], add=True).tolist() == [2] and len(v) == 3


@pytest.mark.full  # the real corpora
def test_paper_sharding_of_the_real_corpora(real_corpus):
    from localclip.data.sharding import worker_shard

    # §4: N = 8 workers; PTB b = 3 (global 24), WikiText-2 b = 10 (global 80).
    n, b = 8, {"ptb": 3, "wikitext2": 10}[real_corpus.name]
    steps = real_corpus.train.numel() // (n * b)
    shards = [worker_shard(real_corpus.train, rank=r, world_size=n, batch_size=b) for r in range(n)]
    assert {s.shape for s in shards} == {(steps, b)}
    assert {"ptb": 38_732, "wikitext2": 26_107}[real_corpus.name] == steps
    flat = torch.cat([s.t().reshape(-1) for s in shards])
    assert torch.equal(flat, real_corpus.train[: steps * n * b])  # streams in corpus order
