"""HuggingFace ``datasets`` on disk as ``data.files``: save_to_disk folders (dataset and dataset
dict) and parquet files give the same documents, a deterministic split and the packed-token cache."""

import pytest

datasets = pytest.importorskip("datasets")

from memtrain.config import ConfigError, DataConfig  # noqa: E402
from memtrain.data import build_corpus  # noqa: E402
from memtrain.data.corpus import iter_documents, select_files, split_files  # noqa: E402

DOCS = [f"def f{i}(x):\n    return x * {i} + {i * i}  # document {i}\n" * 3 for i in range(40)]


def _documents(path, fraction=0.25):
    train, val = split_files(select_files([str(path)], 0, fraction), fraction)
    return list(iter_documents(train, "content")), list(iter_documents(val, "content"))


def test_saved_dataset_rows_are_split_deterministically(tmp_path):
    datasets.Dataset.from_dict({"content": DOCS, "n": list(range(40))}).save_to_disk(str(tmp_path / "ds"))
    train, val = _documents(tmp_path / "ds")
    assert sorted(train + val) == sorted(DOCS) and not set(train) & set(val)
    assert 3 <= len(val) <= 20  # about a quarter of the rows, by hash
    assert _documents(tmp_path / "ds") == (train, val)  # the same on every call (every rank, machine)
    datasets.Dataset.from_dict({"content": DOCS}).to_parquet(str(tmp_path / "docs.parquet"))
    p_train, p_val = _documents(tmp_path / "docs.parquet")
    assert sorted(p_train + p_val) == sorted(DOCS) and not set(p_train) & set(p_val)


def test_dataset_dict_keeps_its_own_validation_split(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"content": DOCS[:30]}),
                               "validation": datasets.Dataset.from_dict({"content": DOCS[30:]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert _documents(tmp_path / "dd") == (DOCS[:30], DOCS[30:])


def test_missing_column_names_the_field_and_the_columns(tmp_path):
    datasets.Dataset.from_dict({"content": DOCS}).save_to_disk(str(tmp_path / "ds"))
    files = select_files([str(tmp_path / "ds")], 0, 0.25)
    with pytest.raises(ConfigError, match="'data.text_field'.*no column 'text'.*content"):
        list(iter_documents(files, "text"))


def test_packed_token_cache_is_keyed_by_the_dataset(tmp_path):
    datasets.Dataset.from_dict({"content": DOCS}).save_to_disk(str(tmp_path / "ds"))
    cfg = DataConfig(files=[str(tmp_path / "ds")], text_field="content", vocab_size=300, seq_len=16,
                     validation_fraction=0.25, cache_dir=str(tmp_path / "cache"))
    first = build_corpus(cfg)
    assert len(first.train) > 0 and len(first.validation) > 0
    caches = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert build_corpus(cfg).train.stream.tolist() == first.train.stream.tolist()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == caches  # read back, not rebuilt
    datasets.Dataset.from_dict({"content": DOCS[::-1]}).save_to_disk(str(tmp_path / "ds2"))
    build_corpus(DataConfig(**{**cfg.__dict__, "files": [str(tmp_path / "ds2")]}))
    assert len(list((tmp_path / "cache").iterdir())) > len(caches)  # other rows: another cache entry


def test_a_glob_over_the_folder_reads_the_dataset_once_and_max_bytes_is_refused(tmp_path):
    datasets.Dataset.from_dict({"content": DOCS[:10] + [None]}).save_to_disk(str(tmp_path / "data" / "ds"))
    files = select_files([str(tmp_path / "data" / "**")], 0, 0.25)
    assert [f.part for f in files] == ["train", "validation"]  # not its .arrow/.json files as well
    docs = list(iter_documents(files, "content"))
    assert sorted(docs) == sorted(DOCS[:10])  # each row once; the null row is no document
    with pytest.raises(ConfigError, match="'data.max_bytes'"):
        select_files([str(tmp_path / "data" / "ds")], 1000, 0.25)



def test_a_split_that_leaves_a_side_empty_is_named(tmp_path):
    """Three rows split at 1% by hash leave the validation side empty at most paths: the run stops
    naming data.validation_fraction and what to do, not with a sample-length error."""
    for n in range(8):  # several folders: the hash depends on the path
        datasets.Dataset.from_dict({"content": DOCS[:3]}).save_to_disk(str(tmp_path / f"ds{n}"))
        cfg = DataConfig(files=[str(tmp_path / f"ds{n}")], text_field="content", vocab_size=300, seq_len=16,
                         validation_fraction=0.01, cache_dir=str(tmp_path / "cache"))
        if not _documents(tmp_path / f"ds{n}", 0.01)[1]:
            with pytest.raises(ConfigError, match="'data.validation_fraction'.*no document on the validation side"):
                build_corpus(cfg)
            return
    pytest.fail("no folder path hashed all three rows to training")  # (0.99^3 per path: not reached)
