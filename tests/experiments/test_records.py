"""Committed records speak to readers: no results file of the examples or the benchmarks names a
folder of the machine it was measured on; their commands write such folders as the variables a
reader sets ($WORK, $USER_DIR, $DATA_DIR), as experiments/portable.py writes them."""

import json
import re
from pathlib import Path

import pytest

from experiments.portable import portable

ROOT = Path(__file__).resolve().parents[2]
RECORDS = sorted([*(ROOT / "examples").rglob("*.json"), *(ROOT / "benchmarks" / "results").glob("*.json")])
# An absolute path of two or more parts (/home/me/runs/x, ~/data/x), or a relative one that leaves
# the repository (../data/ted), where a path can begin: not inside a word, a URL or a variable.
MACHINE_PATH = re.compile(r"(?:^|(?<=[\s=,:;'\"(]))(?:~?/(?:[\w.+-]+/)+[\w.+-]*|(?:\.\./)+[\w.+-]+)")


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


def test_the_pattern_finds_machine_paths_and_nothing_else():
    found = [
        s
        for s in (
            "fairseq-train /home/me/runs/x/bin --user-dir $USER_DIR",
            "--lengths-from ../data/ted/train.gl,../data/ted/train.en",
            "--markdown=/scratch/w/small.md",
            "see ~/data/ted/train.en",
        )
        if MACHINE_PATH.search(s)
    ]
    assert len(found) == 4
    clean = ("$WORK/bin", "$DATA_DIR/train.gl,$DATA_DIR/train.en", "https://github.com/x/y", "tokens/s", "a/b", "1/2")
    assert not [s for s in clean if MACHINE_PATH.search(s)]


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_records_name_no_folder_of_a_machine(path):
    paths = sorted({m for s in strings(json.loads(path.read_text(encoding="utf-8"))) for m in MACHINE_PATH.findall(s)})
    assert paths == [], f"{path.relative_to(ROOT)} names folders of a machine: {paths[:5]}"


def test_records_exist_to_check():
    names = {str(p.relative_to(ROOT)) for p in RECORDS}
    assert {"examples/lr_sweep/results.json", "examples/ted/gl-en-2x2/runs.json"} <= names
    assert sum(n.startswith("benchmarks/results/") for n in names) >= 5


def test_portable_writes_whole_folders_only():
    command = "fairseq-train /data/w/bin --user-dir /src/fq --save-dir /data/w2/x --lengths-from /data/w,/data/w/a"
    assert portable(command, {"/data/w": "$WORK", "/src/fq": "$USER_DIR"}) == (
        "fairseq-train $WORK/bin --user-dir $USER_DIR --save-dir /data/w2/x --lengths-from $WORK,$WORK/a"
    )
    # a relative folder, written as given or as the absolute path it stands for
    assert portable("a work/x/bin b", {"work/x": "$WORK"}) == "a $WORK/bin b"
    assert portable(f"a {Path('work/x').resolve()}/bin", {"work/x": "$WORK"}) == "a $WORK/bin"
