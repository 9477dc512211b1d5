"""With the plugin loaded, a checkpoint carrying an arbitrary pickled object is refused by every
entry point, with a message naming what was refused, and nothing in it runs."""
import os
import shutil

import pytest
import torch

import fairseq_qknorm  # noqa: F401
from conftest import USER_DIR, run, tool, train


class RunsACommand:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def poisoned(trained, tmp_path_factory):
    _, save = trained
    d = tmp_path_factory.mktemp("poisoned")
    ckpt = torch.load(save / "checkpoint_best.pt")
    marker = d / "PWNED"
    ckpt["extra_state"]["payload"] = RunsACommand(marker)
    torch.save(ckpt, d / "checkpoint_last.pt")
    return d, marker


def assert_refused(proc, marker):
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0
    assert last.startswith("error: refused to load checkpoint") and "posix.system" in last, proc.stderr[-2000:]
    assert not marker.exists()


def test_generate_refuses(trained, poisoned):
    data, _ = trained
    d, marker = poisoned
    proc = run([tool("fairseq-generate"), data, "--user-dir", USER_DIR, "--path", d / "checkpoint_last.pt",
                "--cpu", "--required-batch-size-multiple", "1"], check=False)
    assert_refused(proc, marker)


def test_interactive_refuses(trained, poisoned):
    data, _ = trained
    d, marker = poisoned
    proc = run([tool("fairseq-interactive"), data, "--user-dir", USER_DIR, "--path", d / "checkpoint_last.pt",
                "--cpu", "--source-lang", "src", "--target-lang", "tgt"], input="a b c\n", check=False)
    assert_refused(proc, marker)


def test_train_resume_refuses(trained, poisoned, tmp_path):
    data, _ = trained
    d, marker = poisoned
    save = tmp_path / "ckpt"
    save.mkdir()
    shutil.copy(d / "checkpoint_last.pt", save / "checkpoint_last.pt")
    proc = train(data, save, arch="transformer_qknorm_paper", max_update=70, check=False)
    assert_refused(proc, marker)


def test_hub_refuses(trained, poisoned):
    data, _ = trained
    d, marker = poisoned
    code = (f"from fairseq.models.transformer import TransformerModel\n"
            f"TransformerModel.from_pretrained({str(d)!r}, checkpoint_file='checkpoint_last.pt', "
            f"data_name_or_path={str(data)!r}, user_dir={USER_DIR!r})")
    proc = run([tool("python"), "-c", code], check=False)
    assert proc.returncode != 0 and "posix.system" in proc.stderr and not marker.exists()


def test_stock_checkpoint_with_qknorm_flags_is_one_clear_line(trained, tmp_path):
    data, _ = trained
    stock = tmp_path / "stock"
    train(data, stock, arch="transformer_qknorm", max_update=2, extra=["--qk-norm", "none", "--qk-scale", "none"])
    proc = train(data, tmp_path / "ft", arch="transformer_qknorm", max_update=3, check=False,
                 extra=["--finetune-from-model", stock / "checkpoint_last.pt"])
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert last.startswith("error: the checkpoint has no QK-norm parameters"), proc.stderr[-2000:]
