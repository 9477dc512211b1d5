"""TED extraction (experiments.ted) on small made-up files in the format of Qi et al.'s
all_talks_{train,dev,test}.tsv: a talk column, one column per language, NULL markers."""

import io
import sys
import tarfile

import pytest
from conftest import run

from experiments import ted

HEADER = "talk_name\ten\tgl\tpt-br\n"
ROWS = {
    "train": [
        "talk_1\tHello .\tOla .\tOlá .\n",
        "talk_1\tThank you .\t__NULL__\tObrigado .\n",  # gl missing: dropped from gl-en
        "talk_2\tYes .\tSi .\t_ _ NULL _ _\n",  # pt-br missing (tokenized marker): kept in gl-en
        "talk_2\t_ _ NULL _ _\tNon .\tNão .\n",  # en missing: dropped
        "talk_3\tA &quot; quote &quot; .\tUnha &quot; cita &quot; .\tUma citação .\n",
    ],
    "dev": ["talk_4\tOne .\tUn .\tUm .\n", "talk_4\t\tDous .\tDois .\n"],  # an empty field is missing too
    "test": ["talk_5\tThree .\tTres .\tTrês .\n"],
}


def write_tsvs(directory):
    for split, rows in ROWS.items():
        (directory / f"all_talks_{split}.tsv").write_text(HEADER + "".join(rows), encoding="utf-8")


def read_pair(out, src, tgt):
    return {
        split: list(
            zip(
                (out / f"{split}.{src}").read_text(encoding="utf-8").splitlines(),
                (out / f"{split}.{tgt}").read_text(encoding="utf-8").splitlines(),
            )
        )
        for split in ("train", "dev", "test")
    }


EXPECTED_GL_EN = {
    "train": [("Ola .", "Hello ."), ("Si .", "Yes ."), ("Unha &quot; cita &quot; .", "A &quot; quote &quot; .")],
    "dev": [("Un .", "One .")],
    "test": [("Tres .", "Three .")],
}


def test_directory_of_tsvs_to_plain_text_layout(tmp_path):
    write_tsvs(tmp_path)
    out = tmp_path / "gl-en"
    proc = run([sys.executable, "-m", "experiments.ted", tmp_path, "--src", "gl", "--tgt", "en", "--out", out])
    assert read_pair(out, "gl", "en") == EXPECTED_GL_EN
    assert "train: 3 gl-en pairs, 2 rows dropped" in proc.stdout
    # Only complete files, named by language code: the layout the recipes' DATA_DIR takes.
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{s}.{lang}" for s in ("train", "dev", "test") for lang in ("gl", "en")
    )


def test_archive_gives_the_same_pair_and_direction_follows_the_flags(tmp_path):
    write_tsvs(tmp_path)
    archive = tmp_path / "ted_talks.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for split in ROWS:
            tar.add(tmp_path / f"all_talks_{split}.tsv", arcname=f"all_talks_{split}.tsv")
    out = tmp_path / "en-gl"
    ted.main([str(archive), "--src", "en", "--tgt", "gl", "--out", str(out)])
    flipped = {split: [(b, a) for a, b in pairs] for split, pairs in EXPECTED_GL_EN.items()}
    assert read_pair(out, "en", "gl") == flipped


def test_missing_language_is_one_clear_error(tmp_path, capsys):
    write_tsvs(tmp_path)
    with pytest.raises(SystemExit) as e:
        ted.main([str(tmp_path), "--src", "sk", "--tgt", "en", "--out", str(tmp_path / "out")])
    assert "no column for language 'sk'" in str(e.value) and "en, gl, pt-br" in str(e.value)
    assert not list((tmp_path / "out").iterdir())  # nothing half-written


def test_malformed_row_and_missing_split_are_reported(tmp_path):
    write_tsvs(tmp_path)
    with open(tmp_path / "all_talks_dev.tsv", "a", encoding="utf-8") as f:
        f.write("talk_9\tonly two fields\n")
    with pytest.raises(SystemExit) as e:
        ted.main([str(tmp_path), "--src", "gl", "--tgt", "en", "--out", str(tmp_path / "out")])
    assert "all_talks_dev.tsv:4: 2 tab-separated fields, the header has 4" in str(e.value)
    assert not list((tmp_path / "out").glob("dev.*"))  # no partial dev files, not even temporary ones

    (tmp_path / "all_talks_test.tsv").unlink()
    with pytest.raises(SystemExit) as e:
        ted.main([str(tmp_path), "--src", "gl", "--tgt", "en", "--out", str(tmp_path / "out")])
    assert "no all_talks_test.tsv" in str(e.value)


def test_null_markers():
    assert ted.is_missing("__NULL__") and ted.is_missing("_ _ NULL _ _") and ted.is_missing("")
    assert not ted.is_missing("NULL pointers are bad .")
    rows = list(ted.extract_pair(iter(io.StringIO(HEADER + ROWS["test"][0])), "pt-br", "en"))
    assert rows == [("Três .", "Three .")]
