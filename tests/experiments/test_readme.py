"""README.md's Use section is a fairseq command that a user can paste: its fairseq-train and
fairseq-generate lines parse with fairseq's own parsers, the plugin loaded by their --user-dir, and
train the architecture the README names, with QK-norm on."""

import re
import shlex
from pathlib import Path

from fairseq import options

ROOT = Path(__file__).resolve().parents[2]
USER_DIR = str(ROOT / "fairseq_qknorm")


def use_commands():
    """The fairseq commands of the first shell block under "## Use", as argv lists."""
    use = (ROOT / "README.md").read_text(encoding="utf-8").split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", use, re.S).group(1).replace("\\\n", " ")
    commands = [shlex.split(line.replace("$USER_DIR", USER_DIR), comments=True) for line in block.splitlines()]
    return [c for c in commands if c and c[0].startswith("fairseq-")]


def test_the_readme_fairseq_commands_parse_as_pasted():
    commands = use_commands()
    assert [c[0] for c in commands] == ["fairseq-train", "fairseq-generate"]
    train, generate = (c[1:] for c in commands)
    args = options.parse_args_and_arch(options.get_training_parser(), train)
    assert (args.arch, args.user_dir, args.qk_norm, args.qk_scale) == ("transformer_qknorm", USER_DIR, "l2", "learned")
    args = options.parse_args_and_arch(options.get_generation_parser(), generate)
    assert args.user_dir == USER_DIR and args.path.endswith("checkpoint_best.pt")
