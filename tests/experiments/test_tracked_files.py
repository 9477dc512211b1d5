"""Nothing that cannot be diffed enters git: no tracked file is a model checkpoint (by its name, or
by its bytes: torch.save's zip archive or a pickle) or larger than 2 MiB, and every default folder
that a recipe writes its checkpoints and outputs to (WORK, OUT) is one that git ignores and that
holds no tracked file. The history has such files, deleted since: `git clone --depth 1` leaves
them out (README.md)."""

import re
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 2 * 1024 * 1024
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors")
# A default the shell gives a recipe's output folder: ${WORK:-DEFAULT} or ${OUT:-DEFAULT}.
DEFAULT_FOLDER = re.compile(r"\$\{(WORK|OUT):-([^}]*)\}")


def git(*args):
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def tracked():
    """The tracked files that the working tree has (a deletion not yet committed has none)."""
    listing = git("ls-files", "-z")
    if listing.returncode != 0:
        pytest.skip(f"not a git checkout ({listing.stderr.strip()}): these tests check a clone's tracked files")
    files = [ROOT / name for name in listing.stdout.split("\0") if name]
    return [f for f in files if f.is_file()]


def checkpoint_kind(path):
    """What makes PATH a model checkpoint ("named .pt", ...), or None when nothing does."""
    if path.name.endswith(CHECKPOINT_SUFFIXES):
        return f"named {path.suffix}"
    with open(path, "rb") as f:
        head = f.read(4)
    # torch.save's format since torch 1.6: a zip archive holding ARCHIVE/data.pkl and the tensors.
    if head == b"PK\x03\x04" and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            if any(name.endswith("data.pkl") for name in archive.namelist()):
                return "a torch.save archive"
    # torch.save's legacy format, and any other pickled object: the PROTO opcode, protocol 2 to 5.
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "a pickle"
    return None


def test_checkpoint_kind_knows_a_checkpoint_by_its_name_and_by_its_bytes(tmp_path):
    state = {"model": {"w": torch.zeros(3)}}
    torch.save(state, tmp_path / "model.json")
    torch.save(state, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "notes.md").write_text("# results\n")
    (tmp_path / "figure.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    with zipfile.ZipFile(tmp_path / "logs.zip", "w") as archive:
        archive.writestr("train.log", "epoch 1\n")
    kinds = {p.name: checkpoint_kind(p) for p in tmp_path.iterdir()}
    assert kinds == {
        "model.json": "a torch.save archive",
        "legacy.bin": "a pickle",
        "empty.pt": "named .pt",
        "notes.md": None,
        "figure.png": None,
        "logs.zip": None,
    }


def test_no_tracked_file_is_a_checkpoint(tracked):
    found = [f"{f.relative_to(ROOT)} ({kind})" for f in tracked if (kind := checkpoint_kind(f))]
    assert found == [], f"checkpoints are tracked by git (they belong under work/, which git ignores): {found}"


def test_no_tracked_file_is_larger_than_2_mib(tracked):
    assert len(tracked) > 100
    big = [f"{f.relative_to(ROOT)} ({f.stat().st_size:,} bytes)" for f in tracked if f.stat().st_size > LIMIT]
    assert big == [], f"tracked files over {LIMIT:,} bytes: {big}"


def default_folders(tracked):
    """{(script, variable): the folder it writes to by default}, for every ${WORK:-...} and
    ${OUT:-...} of a tracked shell script. $ROOT is the repository; a relative folder is taken from
    the repository's root (where the recipes cd); any other variable in it stands for a name."""
    found = {}
    for script in (f for f in tracked if f.suffix == ".sh"):
        for variable, default in DEFAULT_FOLDER.findall(script.read_text(encoding="utf-8")):
            folder = re.sub(r"\$\{?ROOT\}?", str(ROOT), default)
            folder = re.sub(r"\$\{?\w+\}?", "x", folder)
            found[(str(script.relative_to(ROOT)), f"{variable}={default}")] = (ROOT / folder).resolve()
    return found


def test_every_recipe_writes_by_default_to_a_folder_git_ignores(tracked):
    folders = default_folders(tracked)
    scripts = {script for script, _ in folders}
    # common.sh's default serves run.sh, ablation.sh and the quickstart; the others set their own.
    assert {"examples/common.sh", "examples/ted/gl-en-2x2/run.sh", "examples/interrupt/run.sh"} <= scripts
    assert {"examples/lr_sweep/run.sh", "examples/ted/gl-en-2x2-gpu/run.sh"} <= scripts
    inside = {k: f for k, f in folders.items() if f.is_relative_to(ROOT)}
    assert inside, "no default inside the repository: nothing to check (move this test's checks along)"
    problems = []
    for (script, setting), folder in sorted(inside.items()):
        name = folder.relative_to(ROOT)
        if folder == ROOT or git("check-ignore", "-q", str(name / "train.log")).returncode != 0:
            problems.append(f"{script}: {setting} -> {name}/ is not ignored by git")
        elif git("ls-files", "--", str(name)).stdout:
            problems.append(f"{script}: {setting} -> {name}/ holds tracked files")
    assert problems == []
