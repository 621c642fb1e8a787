"""Classification data: the offline stdlib-packages task and the TFDS path (built locally)."""

import numpy as np
import pytest
import tensorflow_datasets as tfds

from kdist.data import (
    ClassificationBatches,
    classification_dataset,
    load_word_piece,
    stdlib_package_task,
    tfds_task,
)
from kdist.data.classification import DEFAULT_PACKAGES
from kdist.data.wordpiece import train_word_piece

POSITIVE = ["a fine film", "truly great acting", "a joy to watch", "great fun"]
NEGATIVE = ["a dull film", "truly awful acting", "a bore to watch", "no fun"]


class KdistTinyReviews(tfds.core.GeneratorBasedBuilder):
    """A GLUE-shaped text-classification dataset (``sentence``, ``label``, ``idx``; no
    supervised keys), prepared locally in TFDS format by the test."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict({
                "sentence": tfds.features.Text(),
                "label": tfds.features.ClassLabel(names=["negative", "positive"]),
                "idx": np.int32,
            }),
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(range(24)),
                "validation": self._generate_examples(range(24, 32))}

    def _generate_examples(self, indices):
        for i in indices:
            label = i % 2
            text = (POSITIVE if label else NEGATIVE)[i // 2 % 4]
            yield i, {"sentence": f"{text} {i}", "label": label, "idx": i}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "vocabulary.txt"
    train_word_piece(POSITIVE + NEGATIVE + [str(i) for i in range(40)], 256, path)
    return load_word_piece(path)


def test_tfds_dataset_by_name_through_tfds_load(tmp_path, tokenizer):
    KdistTinyReviews(data_dir=str(tmp_path)).download_and_prepare()
    task = tfds_task("kdist_tiny_reviews", data_dir=str(tmp_path))
    assert task.class_names == ["negative", "positive"]
    assert len(task.train_texts) == 24 and len(task.validation_texts) == 8
    by_index = {int(t.split()[-1]): (t, label)
                for t, label in zip(task.train_texts + task.validation_texts,
                                    np.concatenate([task.train_labels, task.validation_labels]))}
    assert by_index[5] == (f"{POSITIVE[2]} 5", 1) and by_index[30] == (f"{NEGATIVE[3]} 30", 0)
    data = classification_dataset("kdist_tiny_reviews", tokenizer, sequence_length=16,
                                  global_batch_size=8, data_dir=str(tmp_path))
    x, y, w = data.validation[0]
    assert x["token_ids"].shape == (8, 16) and (x["token_ids"][:, 0] == 2).all()
    assert sorted(y.tolist()) == [0] * 4 + [1] * 4 and data.majority_baseline == 0.5


def test_tfds_failures_are_fast_and_clear(tmp_path):
    with pytest.raises(ValueError, match="is not prepared in .* download=False"):
        tfds_task("kdist_tiny_reviews", data_dir=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="TFDS has no dataset 'no_such_dataset_kdist'"):
        tfds_task("no_such_dataset_kdist", data_dir=str(tmp_path))


def test_offline_task_splits_by_file():
    task = stdlib_package_task()
    assert task.class_names == list(DEFAULT_PACKAGES)
    train_files, validation_files = set(task.train_groups), set(task.validation_groups)
    assert not train_files & validation_files  # no file on both sides
    assert len(validation_files) >= len(DEFAULT_PACKAGES)
    for split in ("train", "validation"):
        labels = getattr(task, f"{split}_labels")
        groups = getattr(task, f"{split}_groups")
        assert set(labels.tolist()) == set(range(len(DEFAULT_PACKAGES)))  # every class
        # The label is the top-level package of the window's file.
        assert all(g.split("/")[0] == task.class_names[label] for g, label in zip(groups, labels))
    # Windows are real text of their file.
    assert all(len(t.splitlines()) >= 4 for t in task.validation_texts)


def test_validation_batches_cover_every_example_once():
    ids, lengths, labels = np.ones((10, 8), "int32"), np.full(10, 8), np.arange(10)
    ds = ClassificationBatches(ids, lengths, labels, global_batch_size=4, shuffle=False)
    seen = [(y[w > 0]).tolist() for _, y, w in (ds[i] for i in range(len(ds)))]
    assert len(ds) == 3 and sum(seen, []) == list(range(10))
    train = ClassificationBatches(ids, lengths, labels, global_batch_size=4, seed=1)
    x, y, w = train[3]
    assert (w == 1).all() and x["padding_mask"].sum() == 4 * 8
    again = ClassificationBatches(ids, lengths, labels, global_batch_size=4, seed=1)
    np.testing.assert_array_equal(again[3][1], y)  # a pure function of (seed, step)
