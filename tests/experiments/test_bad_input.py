"""Bad raw text and a failed download: one clear line, a non-zero exit, nothing half-written.
experiments.check_text on made-up files, then the recipes' data step (examples/common.sh) on
the same kinds of files and with no network."""

import os
import subprocess
from pathlib import Path

import pytest

from experiments import check_text

ROOT = Path(__file__).resolve().parents[2]
GOOD = {
    "train": (["a b c", "d e", "f g h", "i j"], ["A B C", "D E", "F G H", "I J"]),
    "dev": (["k l", "m n o"], ["K L", "M N O"]),
    "test": (["p q", "r s t"], ["P Q", "R S T"]),
}


def write_corpus(directory, edits=None):
    """{train,dev,test}.{src,tgt} from GOOD; edits: {file name: bytes} replaces whole files."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, (src, tgt) in GOOD.items():
        for lang, lines in (("src", src), ("tgt", tgt)):
            (directory / f"{split}.{lang}").write_bytes("".join(line + "\n" for line in lines).encode())
    for name, data in (edits or {}).items():
        (directory / name).write_bytes(data)
    return directory


def check_fails(tmp_path, edits, capsys=None):
    """Run check_text on a corpus with EDITS; return its error message (and check nothing was written)."""
    data = write_corpus(tmp_path / "in", edits)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        check_text.main([str(data), "--src", "src", "--tgt", "tgt", "--out", str(out)])
    message = str(e.value)
    assert message.startswith("error: ") and "\n" not in message
    assert not out.exists() or not list(out.iterdir())  # not even a temporary file
    return message


def test_blank_pairs_are_dropped_from_train_and_counted(tmp_path, capsys):
    data = write_corpus(
        tmp_path / "in",
        {
            "train.src": b"a b c\n\nf g h\ni j\n",  # line 2: empty source
            "train.tgt": b"A B C\nD E\n \t \nI J\n",  # line 3: whitespace-only target
        },
    )
    check_text.main([str(data), "--src", "src", "--tgt", "tgt", "--out", str(tmp_path / "out")])
    out = tmp_path / "out"
    pairs = list(zip((out / "train.src").read_text().splitlines(), (out / "train.tgt").read_text().splitlines()))
    assert pairs == [("a b c", "A B C"), ("i j", "I J")]  # the rest stays aligned
    assert (out / "test.tgt").read_text() == "P Q\nR S T\n"
    assert "train: 2 sentence pairs, 2 dropped (an empty or whitespace-only side: line 2, 3)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "name, data, expected",
    [
        ("dev.tgt", b"K L\n   \n", "dev.tgt:2: empty or whitespace-only line in a dev/test set"),
        ("test.src", b"\nr s t\n", "test.src:1: empty or whitespace-only line in a dev/test set"),
        ("train.tgt", b"A B C\nD E\nF G H\n", "train.tgt has 3 lines, "),
        ("test.src", b"p q\nr s t\nu v\n", "test.tgt has 2 lines, "),
        (
            "dev.tgt",
            b"K L\nM \xff N O\n",
            "dev.tgt:2: not valid UTF-8 (invalid start byte, byte 0xff at byte 3 of the line)",
        ),
        ("train.src", b"a b c\nd\re\nf g h\ni j\n", "train.src:2: a carriage return (\\r) inside the line"),
    ],
)
def test_bad_text_is_one_clear_error_naming_the_file(tmp_path, name, data, expected):
    message = check_fails(tmp_path, {name: data})
    assert expected in message and str(tmp_path / "in" / name) in message


def test_line_ends_are_not_mismatches(tmp_path):
    # A last line without '\n' (wc -l counts one line less) and Windows line ends are the same lines.
    data = write_corpus(tmp_path / "in", {"train.src": b"a b c\nd e\nf g h\ni j", "dev.tgt": b"K L\r\nM N O\r\n"})
    counts = check_text.check_corpus(data, "src", "tgt", tmp_path / "out")
    assert counts["train"] == (4, []) and (tmp_path / "out" / "train.src").read_text() == "a b c\nd e\nf g h\ni j\n"
    assert (tmp_path / "out" / "dev.tgt").read_bytes() == b"K L\nM N O\n"


# --- the recipes' data step --------------------------------------------------------------------


def data_step(work, pair="toy", **env):
    """examples/common.sh's data step alone (`step data - get_raw_data`): no fairseq, seconds."""
    script = f'source examples/common.sh; set_pair {pair}; set_preset smoke; mkdir -p "$WORK/stamps"; step data - get_raw_data'
    environ = {k: v for k, v in os.environ.items() if k not in ("DATA_DIR", "TED_ARCHIVE", "TED_URL", "IWSLT_URL")}
    environ.update(WORK=str(work), CACHE_DIR=str(work / "cache"), **env)
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=environ, cwd=ROOT)


def last_line(proc):
    return proc.stderr.strip().splitlines()[-1]


def test_recipe_drops_blank_train_pairs_and_stops_on_bad_test_text(tmp_path):
    data = write_corpus(tmp_path / "in", {"train.src": b"a b c\n   \nf g h\ni j\n"})
    proc = data_step(tmp_path / "work", DATA_DIR=str(data))
    assert proc.returncode == 0, proc.stderr
    assert "train: 3 sentence pairs, 1 dropped (an empty or whitespace-only side: line 2)" in proc.stderr
    assert (tmp_path / "work" / "raw" / "train.tgt").read_text() == "A B C\nF G H\nI J\n"
    assert not (tmp_path / "work" / "raw.tmp").exists()

    (data / "test.tgt").write_bytes(b"P Q\nR \xc3 S T\n")  # a truncated two-byte character
    work = tmp_path / "work2"
    proc = data_step(work, DATA_DIR=str(data))
    assert proc.returncode != 0
    assert last_line(proc).startswith(
        f"error: {data}/test.tgt:2: not valid UTF-8 (invalid continuation byte, byte 0xc3"
    )
    # No outputs under the final name and no stamp: the step is redone on the next run.
    assert not (work / "raw").exists() and not (work / "stamps" / "data").exists()


@pytest.mark.parametrize("pair, url_variable", [("gl-en", "TED_URL"), ("en-vi", "IWSLT_URL")])
def test_download_while_offline_is_one_clear_line(tmp_path, pair, url_variable):
    url = "http://127.0.0.1:9/x"  # the discard port: nothing listens, the connection is refused at once
    proc = data_step(tmp_path / "work", pair=pair, **{url_variable: url})
    assert proc.returncode != 0
    assert last_line(proc).startswith(f"error: download of {url}") and "DATA_DIR" in last_line(proc)
    assert "Traceback" not in proc.stderr
    cache = tmp_path / "work" / "cache"
    left = [p.name for p in cache.rglob("*") if p.is_file()] if cache.exists() else []
    assert left == []  # nothing under a final name (no partial download either: nothing was received)
    assert not (tmp_path / "work" / "raw").exists()


def test_recipe_never_cuts_a_test_set_with_sentences_longer_than_the_model(trained, toy_raw, tmp_path):
    """generate_arm on the session's tiny model, the positions lowered to 4 at generation time (the
    task's limit; fairseq takes the smaller of the task's and the model's): one line naming fairseq's
    count, and no translation of a test set with sentences left out."""
    data_bin, checkpoints = trained
    work = tmp_path / "work"
    arm = work / "arms" / "x"
    (work / "raw").mkdir(parents=True)
    arm.mkdir(parents=True)
    (work / "bin").symlink_to(data_bin)
    (arm / "checkpoints").symlink_to(checkpoints)
    (work / "raw" / "test.src").write_text((toy_raw / "test.src").read_text())
    script = 'source examples/common.sh; set_pair toy; set_preset smoke; USER_DIR=$(fairseq-qknorm-user-dir); generate_arm "$WORK/arms/x"'
    env = dict(os.environ, WORK=str(work), DEVICE_FLAGS="--cpu --max-source-positions 4 --max-target-positions 4")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode != 0
    assert "test sentences longer than the model allows" in last_line(proc) and "max_positions=(4, 4)" in last_line(
        proc
    )
    assert "Traceback" not in proc.stderr and not (arm / "test.hyp").exists()
