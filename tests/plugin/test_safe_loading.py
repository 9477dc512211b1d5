"""With the plugin loaded, a checkpoint carrying an arbitrary pickled object is refused by every
entry point, with a message naming what was refused and the file, and nothing in it runs. This
holds under the pinned fairseq (which leaves torch.load's weights_only unset) and under a fairseq
whose loader passes weights_only=False, as upstream fairseq main's does since its "Pt2.6
compatibility" change; that fairseq is built here from the installed one."""

import datetime
import logging
import os
import pickle
import pickletools
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import USER_DIR, decode, run, tool, train, train_args, train_in_this_process

import fairseq_qknorm  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
TRUST = "FAIRSEQ_QKNORM_TRUSTED_CHECKPOINT"


class RunsACommand:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def with_extra(checkpoint, dest, payload):
    """A copy of CHECKPOINT with PAYLOAD pickled into its extra_state, as a tampered file would be."""
    state = torch.load(checkpoint)
    state["extra_state"]["payload"] = payload
    torch.save(state, dest)
    return dest


@pytest.fixture(scope="module")
def poisoned(trained, tmp_path_factory):
    _, save = trained
    d = tmp_path_factory.mktemp("poisoned")
    marker = d / "PWNED"
    with_extra(save / "checkpoint_best.pt", d / "checkpoint_last.pt", RunsACommand(marker))
    return d, marker


@pytest.fixture(scope="module")
def fairseq_without_weights_only(tmp_path_factory):
    """A fairseq whose checkpoint_utils passes weights_only=False to torch.load: the installed
    fairseq with that file edited and every other entry linked."""
    import fairseq

    installed = Path(fairseq.__file__).parent
    root = tmp_path_factory.mktemp("fairseq_weights_only_false")
    (root / "fairseq").mkdir()
    for entry in installed.iterdir():
        if entry.name not in ("checkpoint_utils.py", "__pycache__"):
            (root / "fairseq" / entry.name).symlink_to(entry)
    source = (installed / "checkpoint_utils.py").read_text()
    edited, calls = re.subn(r"torch\.load\(\s*f,", "torch.load(f, weights_only=False,", source)
    assert calls == 2  # load_checkpoint_to_cpu, load_ema_from_checkpoint
    (root / "fairseq" / "checkpoint_utils.py").write_text(edited)
    return root


@pytest.fixture(params=["pinned fairseq", "fairseq passing weights_only=False"])
def fairseq_env(request):
    """Environment for a subprocess that imports the pinned fairseq, or the one built above."""
    if request.param == "pinned fairseq":
        return {}
    root = request.getfixturevalue("fairseq_without_weights_only")
    return {"PYTHONPATH": os.pathsep.join([str(root), str(ROOT)])}


def assert_refused(proc, marker, refused="posix.system", path=None):
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    assert proc.returncode != 0
    assert last.startswith("error: refused to load checkpoint") and refused in last, proc.stderr[-2000:]
    assert path is None or str(path) in last
    assert "Traceback" not in proc.stderr
    assert not marker.exists()


def load_to_cpu(paths, env, plugin=True):
    """fairseq's checkpoint_utils.load_checkpoint_to_cpu on each of PATHS in turn, in one subprocess
    (each load that returns prints "loaded PATH"; one refused ends it)."""
    code = (
        "import sys\n"
        + ("import fairseq_qknorm\n" if plugin else "")
        + "from fairseq import checkpoint_utils\n"
        + "for path in sys.argv[1:]:\n"
        + "    checkpoint_utils.load_checkpoint_to_cpu(path)\n"
        + "    print('loaded', path)"
    )
    return run([tool("python"), "-c", code, *paths], env=env, check=False)


def test_the_built_fairseq_runs_the_payload_without_the_plugin(trained, fairseq_without_weights_only, tmp_path):
    """What the tests below guard against: this fairseq alone runs what the checkpoint holds."""
    _, save = trained
    marker = tmp_path / "PWNED"
    path = with_extra(save / "checkpoint_best.pt", tmp_path / "poisoned.pt", RunsACommand(marker))
    env = {"PYTHONPATH": str(fairseq_without_weights_only)}
    load_to_cpu([path], env, plugin=False)
    assert marker.exists()


def test_generate_refuses(trained, poisoned, fairseq_env):
    data, _ = trained
    d, marker = poisoned
    proc = decode(
        "fairseq-generate",
        data,
        d / "checkpoint_last.pt",
        "--cpu --required-batch-size-multiple 1",
        env=fairseq_env,
        check=False,
    )
    assert_refused(proc, marker, path=d / "checkpoint_last.pt")


def test_interactive_refuses(trained, poisoned, fairseq_env):
    data, _ = trained
    d, marker = poisoned
    proc = decode(
        "fairseq-interactive",
        data,
        d / "checkpoint_last.pt",
        "--cpu --source-lang src --target-lang tgt",
        input="a b c\n",
        env=fairseq_env,
        check=False,
    )
    assert_refused(proc, marker)


def test_train_resume_refuses(trained, poisoned, fairseq_env, tmp_path):
    data, _ = trained
    d, marker = poisoned
    save = tmp_path / "ckpt"
    save.mkdir()
    shutil.copy(d / "checkpoint_last.pt", save / "checkpoint_last.pt")
    proc = train(data, save, arch="transformer_qknorm_paper", max_update=70, env=fairseq_env, check=False)
    assert_refused(proc, marker, path=save / "checkpoint_last.pt")


@pytest.fixture(scope="module")
def hub_loads(trained, poisoned):
    """The hub's from_pretrained on the normal checkpoint, then on the poisoned one, in one subprocess
    per fairseq (the normal load prints "loaded"; the refused one ends the process)."""
    data, save = trained
    d, _ = poisoned
    code = "from fairseq.models.transformer import TransformerModel\n" + "".join(
        f"TransformerModel.from_pretrained({str(directory)!r}, checkpoint_file={name!r}, "
        f"data_name_or_path={str(data)!r}, user_dir={USER_DIR!r})\nprint('loaded', {name!r})\n"
        for directory, name in [(save, "checkpoint_best.pt"), (d, "checkpoint_last.pt")]
    )
    runs = {}

    def loads(env):
        key = tuple(sorted(env.items()))
        if key not in runs:
            runs[key] = run([tool("python"), "-c", code], env=env, check=False)
        return runs[key]

    return loads


def test_hub_refuses(poisoned, fairseq_env, hub_loads):
    _, marker = poisoned
    assert_refused(hub_loads(fairseq_env), marker)


def test_inspect_refuses(poisoned, fairseq_env):
    d, marker = poisoned
    proc = run([tool("fairseq-qknorm-inspect"), "g", d / "checkpoint_last.pt"], env=fairseq_env, check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and last.startswith("error: ") and str(d / "checkpoint_last.pt") in last
    assert "Weights only load failed" in last and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not marker.exists()


@pytest.fixture(scope="module")
def fairseq_checkout(fairseq_without_weights_only, tmp_path_factory):
    """A fairseq source checkout: the fairseq built above, and scripts/average_checkpoints.py, which
    no fairseq wheel ships; its loading call as upstream's, with weights_only=False."""
    root = tmp_path_factory.mktemp("fairseq_checkout")
    (root / "fairseq").symlink_to(fairseq_without_weights_only / "fairseq")
    (root / "scripts").mkdir()
    (root / "scripts" / "__init__.py").write_text("")
    (root / "scripts" / "average_checkpoints.py").write_text(
        "import torch\n"
        "from fairseq.file_io import PathManager\n\n\n"
        "def average_checkpoints(inputs):\n"
        "    states = []\n"
        "    for fpath in inputs:\n"
        "        with PathManager.open(fpath, 'rb') as f:\n"
        "            states.append(torch.load(f, map_location=(lambda s, _: "
        "torch.serialization.default_restore_location(s, 'cpu')), weights_only=False))\n"
        "    new_state = states[0]\n"
        "    new_state['model'] = {k: sum(s['model'][k].float() for s in states) / len(states) "
        "for k in new_state['model']}\n"
        "    return new_state\n"
    )
    return root


def average(checkout, *pairs):
    """The checkout's average_checkpoints on each pair of checkpoints in turn, in one subprocess."""
    code = (
        "import sys\nimport fairseq_qknorm\nfrom scripts.average_checkpoints import average_checkpoints\n"
        "for pair in zip(sys.argv[1::2], sys.argv[2::2]):\n"
        "    print(len(average_checkpoints(list(pair))['model']), 'tensors averaged')"
    )
    paths = [path for pair in pairs for path in pair]
    return run([tool("python"), "-c", code, *paths], cwd=checkout, env={"PYTHONPATH": str(ROOT)}, check=False)


def test_checkpoint_averaging_of_a_fairseq_checkout_refuses(trained, poisoned, fairseq_checkout):
    _, save = trained
    d, marker = poisoned
    normal = [save / "checkpoint_best.pt", save / "checkpoint_last.pt"]
    proc = average(fairseq_checkout, normal, [save / "checkpoint_best.pt", d / "checkpoint_last.pt"])
    assert "tensors averaged" in proc.stdout, proc.stderr[-2000:]  # the normal pair, first
    assert_refused(proc, marker, path=d / "checkpoint_last.pt")


def test_a_normal_checkpoint_loads(trained, fairseq_env, hub_loads):
    data, save = trained
    decode(
        "fairseq-generate",
        data,
        save / "checkpoint_best.pt",
        "--cpu --required-batch-size-multiple 1 --max-sentences 8",
        env=fairseq_env,
    )
    proc = hub_loads(fairseq_env)
    assert "loaded checkpoint_best.pt" in proc.stdout, proc.stderr[-2000:]


def test_torch_switch_does_not_turn_safe_loading_off(poisoned):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD only changes loads that leave weights_only unset."""
    d, marker = poisoned
    assert_refused(load_to_cpu([d / "checkpoint_last.pt"], {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}), marker)


@pytest.fixture(scope="module")
def old_checkpoint(trained, tmp_path_factory):
    """A benign checkpoint holding a class no fairseq checkpoint holds (a datetime.date)."""
    _, save = trained
    return with_extra(save / "checkpoint_best.pt", tmp_path_factory.mktemp("old") / "old.pt", datetime.date(2020, 1, 1))


def test_trusted_checkpoint_loads_with_a_warning_naming_it(trained, old_checkpoint, fairseq_env):
    data, _ = trained
    generate = [
        tool("fairseq-generate"),
        data,
        "--user-dir",
        USER_DIR,
        "--path",
        old_checkpoint,
        "--cpu",
        "--required-batch-size-multiple",
        "1",
        "--max-sentences",
        "8",
    ]
    refused = run(generate, env=fairseq_env, check=False)
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode != 0 and "datetime.date" in last and TRUST in last, refused.stderr[-2000:]

    trusted = run(generate, env={**fairseq_env, TRUST: str(old_checkpoint)})
    warning = [line for line in trusted.stderr.splitlines() if TRUST in line]
    assert len(warning) == 1 and "WARNING" in warning[0] and str(old_checkpoint) in warning[0], trusted.stderr[-2000:]


def test_trust_is_per_file(trained, old_checkpoint, poisoned):
    """Naming one file trusts that file only: the poisoned checkpoint beside it is still refused
    (loaded after the trusted one, in the same process)."""
    d, marker = poisoned
    env = {TRUST: os.pathsep.join([str(old_checkpoint), str(d / "other.pt")])}
    proc = load_to_cpu([old_checkpoint, d / "checkpoint_last.pt"], env)
    assert f"loaded {old_checkpoint}" in proc.stdout, proc.stderr[-2000:]
    assert_refused(proc, marker)


def test_stock_checkpoint_with_qknorm_flags_is_one_clear_line(trained, tmp_path):
    data, _ = trained
    stock = tmp_path / "stock"
    train_in_this_process(train_args(data, stock, max_update=2, extra=["--qk-norm", "none", "--qk-scale", "none"]))
    proc = train(
        data,
        tmp_path / "ft",
        arch="transformer_qknorm",
        max_update=3,
        check=False,
        extra=["--finetune-from-model", stock / "checkpoint_last.pt"],
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert last.startswith("error: the checkpoint has no QK-norm parameters"), proc.stderr[-2000:]


# The allow-list, by the names pickles give its entries: what fairseq-train writes (the arguments; with
# --eval-bleu, numpy's statistics), and what a distributed resume broadcasts (fairseq_patches.py).
FAIRSEQ_CHECKPOINT_GLOBALS = {
    "argparse.Namespace",
    "numpy._core.multiarray._reconstruct",
    "numpy.core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.dtypes.Int64DType",
    "numpy.dtypes.Float64DType",
    "omegaconf.dictconfig.DictConfig",
    "omegaconf.listconfig.ListConfig",
    "omegaconf.base.ContainerMetadata",
    "omegaconf.base.Metadata",
    "omegaconf.nodes.AnyNode",
    "typing.Any",
    "builtins.dict",
    "builtins.list",
    "builtins.int",
    "collections.defaultdict",
    "fairseq.distributed.utils._TensorPlaceholder",
}


def pickled_name(entry):
    """The name a pickle gives an allow-list entry: a class or function, or (object, name)."""
    if isinstance(entry, tuple):
        return entry[1]
    return f"{entry.__module__}.{entry.__qualname__}"


def test_the_allow_list_is_exactly_the_classes_fairseq_checkpoints_hold():
    from fairseq_qknorm.fairseq_patches import fairseq_checkpoint_globals

    assert {pickled_name(g) for g in fairseq_checkpoint_globals()} == FAIRSEQ_CHECKPOINT_GLOBALS


def checkpoint_globals(path):
    """Every global a checkpoint's pickle names, read with pickletools: nothing in it is run."""
    with zipfile.ZipFile(path) as archive:
        (pkl,) = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        ops = list(pickletools.genops(archive.read(pkl)))
    assert not any(op.name == "STACK_GLOBAL" for op, _, _ in ops)  # torch.save's protocol 2 names each in one op
    return {arg.replace(" ", ".").replace("__builtin__.", "builtins.") for op, arg, _ in ops if op.name == "GLOBAL"}


def test_what_torch_does_not_allow_by_itself_in_a_real_checkpoint_is_on_the_list(trained):
    """fairseq-train's checkpoint with --eval-bleu: its globals beyond torch's own are the list's."""
    from torch._weights_only_unpickler import _get_allowed_globals

    _, save = trained
    beyond_torch = checkpoint_globals(save / "checkpoint_best.pt") - set(_get_allowed_globals())
    assert "argparse.Namespace" in beyond_torch and "numpy.ndarray" in beyond_torch, beyond_torch
    assert beyond_torch <= FAIRSEQ_CHECKPOINT_GLOBALS


class Calls:
    """A pickled call of FUNCTION(*ARGS), as a tampered checkpoint would hold it."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


# Payloads from modules outside torch's own blocklist (sys, os, posix, nt: posix.system above is
# refused whatever the allow-list says): only the allow-list stands between them and a run.
NOT_BLOCKED_BY_TORCH = {
    "exec": lambda marker: Calls(exec, f"open({str(marker)!r}, 'w').close()"),
    "eval": lambda marker: Calls(eval, f"open({str(marker)!r}, 'w').close()"),
    # a class that acts when built: it opens its file, creating it, or emptying it with mode "w"
    "logging.FileHandler": lambda marker: Calls(logging.FileHandler, str(marker), "w"),
}


@pytest.mark.parametrize("refused", list(NOT_BLOCKED_BY_TORCH))
def test_payloads_torch_would_run_if_allowed_are_refused(tmp_path, refused):
    from fairseq import checkpoint_utils

    from fairseq_qknorm.errors import one_line

    marker = tmp_path / "PWNED"
    path = tmp_path / "checkpoint_last.pt"
    torch.save({"model": {}, "extra_state": {"payload": NOT_BLOCKED_BY_TORCH[refused](marker)}}, path)
    with pytest.raises(Exception) as refusal:  # allowed, the payload would run, and this file fail later
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    assert not marker.exists(), f"{refused} ran"
    assert isinstance(refusal.value, pickle.UnpicklingError), refusal.value
    assert one_line(refusal.value).startswith(f"refused to load checkpoint {path}: it holds {refused}, which")
