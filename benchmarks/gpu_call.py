"""The GPU call's measurements (benchmarks/gpu_call.sh runs them): does transformer_qknorm train and
beam-search at stock fairseq's speed and memory on a GPU, in fp16 and bf16, at real sizes?

    python -m benchmarks.gpu_call --out OUT --lengths-from SRC,TGT [--seconds S] [--smoke] [--resume]
        [--parts PART ...] [--arms ARM ...] [--rounds N] [--profile-below RATIO] [--profiles N]

Parts (PLAN, in the order they run, the most wanted first): training of the paper's gl-en model and
of transformer base in fp16 and bf16, their beam search, then transformer big's training, the
language model's (transformer_lm_qknorm against transformer_lm, blocks of 512 tokens), and big's beam
search. Each part builds every arm in this one process (benchmarks.gpu_bench), runs every unit of
work once untimed (SDPA and cuDNN plan a kernel for each new shape), records which SDPA kernel each
arm ran, then times rounds of the units, interleaved arm by arm as benchmarks.run does, the order
rotating each round, until --rounds or the part's share of the time. After each part
OUT/gpu-table.json and OUT/gpu-table.md are rewritten (benchmarks.gpu_report). When a QK-norm arm is
below --profile-below of stock, it and stock are profiled on the same units (torch.profiler) into
OUT/gpu-profile.txt, for the first --profiles such parts.

An arm that raises (out of memory, say) is logged and left out; the part goes on with the others.
A part whose stock fails, or that runs out of time, is recorded as such and the next one starts. A
part still running HANG_SECONDS past its time is taken as hung: the process prints every thread's
stack and exits 1, and --resume (the shell script reruns it so) records that part as failed and
measures the rest. --smoke: every part at a tiny size (on the CPU where there is no GPU), for the
dry run (tests/experiments/test_gpu_call.py)."""

import argparse
import datetime
import faulthandler
import functools
import gc
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from experiments.machine import cpu_name
from experiments.portable import portable

from .gpu_report import MEASURED, part_fields, ratio_stats, read, write
from .lengths import read_pair_lengths
from .report import BASELINE, target_arms
from .run import LENGTHS_ENV, ROOT, git_commit
from .variants import QK_VARIANTS

PRECISIONS = ("fp16", "bf16")
PLAN = (
    [f"train-{m}-{d}" for m in ("glen", "base") for d in PRECISIONS]
    + [f"generate-{m}-{d}" for m in ("glen", "base") for d in PRECISIONS]
    + [f"train-{m}-{d}" for m in ("big", "lm") for d in PRECISIONS]
    + [f"generate-big-{d}" for d in PRECISIONS]
)
# stock, stock again (the noise floor), QKNorm (l2, learned g), QK LayerNorm and QK RMSNorm (the
# sweeps' arms: 1/sqrt(d), no g)
ARMS = ("stock", "stock_control", "qknorm", "qknorm_layernorm_none", "qknorm_rmsnorm_none")
# In beam search also stock with fairseq's beamable cross attention, which transformer_qknorm uses
# in every search and fairseq's transformer never: the like-for-like reference (BENCHMARKS.md).
GENERATE_ONLY = ("stock_beamable",)

GPU = dict(
    sizes={"glen": "glen", "base": "base", "big": "big", "lm": "lm"},
    train_tokens=(4096, 8192),  # --max-tokens of the two batch sizes
    train_sentences=800,  # TED gl-en's lengths: 12 batches of 4,096 tokens, 7 of 8,192 (17,438 target tokens)
    lm_tokens=16384,  # per batch size: 4 batches of 4,096 tokens (8 blocks), 2 of 8,192
    gen_sentences=(64, 128),
    beam=5,
    max_len=256,
    rounds=5,
)
SMOKE = dict(
    GPU,
    sizes=dict.fromkeys(GPU["sizes"], "tiny"),
    train_tokens=(64, 128),
    train_sentences=12,
    lm_tokens=256,
    gen_sentences=(4, 8),
    max_len=8,
    rounds=2,
)
MIN_ROUNDS = 2  # timed rounds a part runs past its share of the time, for a spread
MIN_PART_SECONDS = 20  # a part with less time left is not started
HANG_SECONDS = 60
PROFILE_UNITS = 3
PROFILE_FILE = "gpu-profile.txt"


def log(message):
    print(f"| {datetime.datetime.now():%H:%M:%S} gpu_call: {message}", file=sys.stderr, flush=True)


def one_line(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def plugin_sha1():
    """sha1 of the plugin's source as imported: which code ran, with or without git."""
    from fairseq_qknorm import USER_DIR

    h = hashlib.sha1()
    for path in sorted(Path(USER_DIR).rglob("*.py")):
        h.update(str(path.relative_to(USER_DIR)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def machine(device):
    """The device, its driver, torch, CUDA and cuDNN versions (what a machine lacks: None)."""
    import fairseq
    import torch

    record = {
        "device": cpu_name(),
        "driver": None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "fairseq": fairseq.__version__,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "commit": git_commit(),
        "plugin_sha1": plugin_sha1(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        record["device"] = f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
        try:
            smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            record["driver"] = subprocess.run(smi, capture_output=True, text=True, timeout=20).stdout.split()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            pass
    return record


def rotated(names, r):
    """A B C, then B C A, ...: each arm in every position of the order (as benchmarks.run)."""
    return names[r % len(names) :] + names[: r % len(names)]


class Call:
    def __init__(self, args, conf, device, lengths, scratch):
        self.args, self.conf, self.device, self.lengths = args, conf, device, lengths
        self.scratch = scratch  # where fairseq writes crash.pt when a step raises (not OUT: it comes back)
        self.out = Path(args.out)
        self.json = self.out / "gpu-table.json"
        self.end = time.time() + args.seconds

    def save(self, record=None):
        if record is not None:
            parts = self.result["parts"]
            names = [p["name"] for p in parts]
            if record["name"] in names:
                parts[names.index(record["name"])] = record
            else:
                parts.append(record)
        write(self.result, self.json, self.out / "gpu-table.md")

    def run(self, names):
        done = {p["name"] for p in self.result["parts"]}
        pending = [n for n in PLAN if n in names and n not in done]
        for i, name in enumerate(pending):
            left = self.end - time.time()
            if left < MIN_PART_SECONDS:
                log(f"{name}: not run, {left:.0f} s left")
                self.save(dict(part_fields(name), status="not run", note=f"{max(left, 0):.0f} s were left"))
                continue
            share = left / (len(pending) - i)
            soft, hard = time.time() + share, min(self.end, time.time() + 3 * share)
            log(f"{name}: {share:.0f} s ({3 * share:.0f} s at most, {left:.0f} s left for {len(pending) - i} parts)")
            faulthandler.dump_traceback_later(hard - time.time() + HANG_SECONDS, exit=True)
            record = dict(part_fields(name), status="running", note="", arms={}, settings=[])
            self.save(record)
            started = time.time()
            try:
                self.measure(record, soft, hard)
            except Exception as e:  # noqa: BLE001 - a part that fails is recorded; the next one runs
                traceback.print_exc()
                record.update(status="failed", note=one_line(e))
            finally:
                faulthandler.cancel_dump_traceback_later()
                self.release()
            record["seconds"] = round(time.time() - started, 1)
            log(f"{name}: {record['status']} in {record['seconds']} s{': ' + record['note'] if record['note'] else ''}")
            self.save(record)

    def release(self):
        """The part's arms gone; on CUDA their memory back to the allocator before the next."""
        self.runners = {}
        self.release_arm()

    def drop(self, record, arm, e):
        log(f"{record['name']}: {arm} failed, left out: {one_line(e)}")
        traceback.print_exc()
        record["arms"].setdefault(arm, {})["error"] = one_line(e)
        self.runners.pop(arm, None)
        self.release_arm()

    def release_arm(self):
        if self.device == "cuda":
            import torch

            gc.collect()
            torch.cuda.empty_cache()

    def measure(self, record, soft, hard):
        from .gpu_bench import allocated, attention_kernels, build_part, measured

        benchmark, model, dtype = record["benchmark"], record["model"], record["dtype"]
        arms = list(self.args.arms) + list(GENERATE_ONLY if benchmark == "generate" else ())
        part = build_part(
            benchmark,
            model,
            dtype,
            self.device,
            self.conf,
            self.lengths,
            tuple(self.args.lengths_from.split(",")),
            self.scratch,
        )
        record["unit"] = part.unit_name
        n_settings = len(part.settings)
        self.runners, state, high = {}, {}, {}
        for arm in arms:  # one after the other: the memory each one keeps is what it adds
            before = allocated(self.device)
            try:
                runner = part.build(arm)
                # its first unit: which SDPA kernels it runs; the optimizer's state exists from then on
                kernels = attention_kernels(functools.partial(runner.run, 0, 0))
            except Exception as e:  # noqa: BLE001
                self.drop(record, arm, e)
                continue
            self.runners[arm] = runner
            # what the arm keeps between units: its weights, its optimizer's state
            state[arm] = None if before is None else getattr(runner, "kept_bytes", allocated(self.device) - before)
            high[arm] = [0] * n_settings
            record["arms"][arm] = dict(runner.info, attention=kernels, state_bytes=state[arm], error=None)
            if time.time() > hard:
                break
        if BASELINE not in self.runners:
            record.update(status="failed", note=f"{BASELINE} failed: no ratios")
            return

        def unit(arm, s, u):
            """Runs one unit of one arm; its seconds (None where the arm failed)."""
            if arm not in self.runners:
                return None
            try:
                seconds, peak = measured(lambda: self.runners[arm].run(s, u), self.device)
            except Exception as e:  # noqa: BLE001
                self.drop(record, arm, e)
                return None
            if peak is not None:
                high[arm][s] = max(high[arm][s], peak)
            return seconds

        for s, (_, counts) in enumerate(part.settings):  # the warm-up round
            for u in range(len(counts)):
                for arm in list(self.runners):
                    unit(arm, s, u)
                if time.time() > hard:
                    record.update(status="cut off", note="its time ran out in the untimed round")
                    return

        def timed_round(r):
            """{arm: [[seconds, count] per setting]} of one round; None when the part's time ran out."""
            totals = {arm: [[0.0, 0] for _ in part.settings] for arm in self.runners}
            for s, (_, counts) in enumerate(part.settings):
                for u, count in enumerate(counts):
                    for arm in rotated(list(self.runners), r):
                        seconds = unit(arm, s, u)
                        if seconds is not None:
                            totals[arm][s][0] += seconds
                            totals[arm][s][1] += count
                    if time.time() > hard:
                        return None
            return totals

        speeds = {arm: [[] for _ in part.settings] for arm in self.runners}
        record["round_seconds"] = 0.0
        for r in range(self.args.rounds):
            if r >= MIN_ROUNDS and time.time() + record["round_seconds"] > soft:
                break
            begun, totals = time.time(), timed_round(r)
            if totals is None:
                log(f"{record['name']}: its time ran out in timed round {r + 1}, which is left out")
                break
            for arm in self.runners:  # the arms that finished the round
                for s, (seconds, count) in enumerate(totals[arm]):
                    speeds[arm][s].append(count / seconds)
            record["round_seconds"] = round(time.time() - begun, 2)
        if BASELINE not in self.runners:
            record.update(status="failed", note=f"{BASELINE} failed: no ratios")
            return
        rounds = len(speeds[BASELINE][0])
        if rounds == 0:
            record.update(status="cut off", note="its time ran out before a timed round ended")
            return
        record["rounds"] = rounds
        for s, (label, counts) in enumerate(part.settings):
            rows = {}
            base = None if state[BASELINE] is None else state[BASELINE] + high[BASELINE][s]
            for arm in speeds:
                peak = None if state[arm] is None else state[arm] + high[arm][s]
                rows[arm] = {
                    "speed": speeds[arm][s],
                    "ratio": ratio_stats(speeds[arm][s], speeds[BASELINE][s]),
                    "peak_bytes": peak,
                    "memory_ratio": None if peak is None or not base else peak / base,
                }
            record["settings"].append({"label": label, "units": len(counts), "arms": rows})
        for arm, runner in self.runners.items():
            record["arms"][arm]["skipped_updates"] = getattr(runner, "skipped", 0)
        if benchmark == "generate":
            tokens = {
                arm: [r.output_tokens(s) for s in range(n_settings)]
                for arm, r in self.runners.items()
                if hasattr(r, "output_tokens")
            }
            if len({tuple(t) for t in tokens.values()}) > 1:
                record["note"] = f"the arms generated different numbers of tokens: {tokens}"
        record["status"] = MEASURED
        if rounds < self.args.rounds:
            record["note"] = (
                record["note"] + "; " if record["note"] else ""
            ) + f"{rounds} of {self.args.rounds} rounds in its time"
        self.profile_slowest(record, part, hard)

    def profile_slowest(self, record, part, hard):
        """Stock and the slowest QK-norm arm below --profile-below, on the same units, into
        OUT/gpu-profile.txt; for the first --profiles such parts, when the part's time allows."""
        from .gpu_bench import profile_table

        rows = [
            (row["ratio"]["median"], arm, s)
            for s, setting in enumerate(record["settings"])
            for arm, row in setting["arms"].items()
            if arm in target_arms([arm]) and arm in self.runners and row["ratio"]
        ]
        if not rows or len(self.result["profiles"]) >= self.args.profiles:
            return
        ratio, arm, s = min(rows)
        if ratio >= self.args.profile_below or BASELINE not in self.runners:
            return
        units = range(min(PROFILE_UNITS, len(part.settings[s][1])))
        if time.time() + record["round_seconds"] > hard:  # a round's time: more than the profile takes
            return
        label = record["settings"][s]["label"]
        header = f"{record['name']}, {label}: {arm} at {ratio:.3f} of {BASELINE}; {len(units)} unit(s) each"
        text = [f"## {header}"]
        for name in (BASELINE, arm):
            runner = self.runners[name]
            table = profile_table([functools.partial(runner.run, s, u) for u in units], self.device)
            text += ["", f"### {name}", "", table]
        with open(self.out / PROFILE_FILE, "a", encoding="utf-8") as f:
            f.write("\n".join(text) + "\n\n")
        record["profile"] = {"arm": arm, "setting": label, "ratio": ratio}
        self.result["profiles"].append(record["name"])
        log(f"profiled: {header}")


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_call",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, help="gpu-table.json, gpu-table.md and gpu-profile.txt go here")
    p.add_argument(
        "--lengths-from",
        default=os.environ.get(LENGTHS_ENV),
        metavar="SRC,TGT",
        help=f"parallel text whose sentence lengths the translation batches copy (default: ${LENGTHS_ENV})",
    )
    p.add_argument("--seconds", type=float, default=520, help="time for all parts, from now (default 520)")
    p.add_argument("--command", help="what ran this, for the table (default: this command line)")
    p.add_argument("--smoke", action="store_true", help="every part at a tiny size: the dry run")
    p.add_argument("--resume", action="store_true", help="keep the parts OUT/gpu-table.json holds; measure the rest")
    p.add_argument(
        "--parts", nargs="+", choices=PLAN, default=list(PLAN), help="a subset of the plan (its order stays)"
    )
    p.add_argument(
        "--arms",
        nargs="+",
        choices=("stock", "stock_control", *QK_VARIANTS),
        default=list(ARMS),
        help="the arms (stock always runs: the base of the ratios); default: " + " ".join(ARMS),
    )
    p.add_argument("--rounds", type=int, help="timed rounds per part at most (default 5; 2 with --smoke)")
    p.add_argument("--profile-below", type=float, default=0.97, help="profile a QK-norm arm below this ratio to stock")
    p.add_argument("--profiles", type=int, default=4, help="profile at most this many parts (default 4)")
    args = p.parse_args(argv)
    if not args.lengths_from or len(args.lengths_from.split(",")) != 2:
        p.error(f"--lengths-from SRC,TGT (or ${LENGTHS_ENV}) is needed")
    if args.seconds <= 0 or (args.rounds is not None and args.rounds < 1) or args.profiles < 0:
        p.error("--seconds, --rounds: expected positive numbers; --profiles: zero or more")
    args.arms = [BASELINE, *(a for a in args.arms if a != BASELINE)]
    return args


def checked_args(argv=None):
    """The arguments and the sentence lengths, or a one-line error (before torch and fairseq load)."""
    args = parse_args(argv)
    try:
        return args, read_pair_lengths(*args.lengths_from.split(","))
    except ValueError as e:
        sys.exit(f"error: {e}")


def main(argv=None):
    measure_all(*checked_args(argv), argv)


def measure_all(args, lengths, argv=None):
    conf = SMOKE if args.smoke else GPU
    args.rounds = args.rounds or conf["rounds"]
    import torch

    from . import gpu_bench

    device = "cuda" if torch.cuda.is_available() else "cpu"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    scratch = tempfile.TemporaryDirectory(prefix="gpu_call_")
    call = Call(args, conf, device, lengths, scratch.name)
    if args.resume and call.json.is_file():
        call.result = read(call.json)
        for p in call.result["parts"]:
            if p["status"] == "running":
                p.update(
                    status="failed",
                    note="the measuring process ended during this part: a crash, or a hang past its time (its stacks are then in the log)",
                )
        call.result["meta"]["resumed"].append(datetime.datetime.now().isoformat(timespec="seconds"))
    else:
        call.result = {
            "meta": {
                "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "command": args.command or "python -m benchmarks.gpu_call " + " ".join(argv or sys.argv[1:]),
                "smoke": args.smoke,
                "plan": [n for n in PLAN if n in args.parts],
                "arms": args.arms,
                "rounds": args.rounds,
                "settings": conf,
                "lengths_from": portable(args.lengths_from, {ROOT: "."}),
                "machine": machine(device),
                "resumed": [],
            },
            "parts": [],
            "profiles": [],
        }
        (call.out / PROFILE_FILE).unlink(missing_ok=True)
    call.save()
    gpu_bench.first_use(device)
    log(f"on {call.result['meta']['machine']['device']}: {len(args.parts)} parts, arms {' '.join(args.arms)}")
    call.run(args.parts)


def quiet_process():
    """The command's log: fairseq's warnings (an out-of-memory, say) and this module's lines, not
    each Trainer's INFO lines nor hydra's notices at every configuration built; on the CPU (the dry
    run, beside whatever else runs there) one thread."""
    import fairseq  # noqa: F401  (which sets the root logger to DEBUG)
    import torch

    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.WARNING, force=True
    )
    warnings.filterwarnings("ignore", module=r"hydra\.")
    warnings.filterwarnings("ignore", message=r"\s*'config' is validated against ConfigStore")
    if not torch.cuda.is_available():
        torch.set_num_threads(1)


if __name__ == "__main__":
    checked = checked_args()
    quiet_process()
    measure_all(*checked)
