"""The gl-en 2x2 trained until dev BLEU stops improving: one driver per run, one record per run.

    python -m experiments.gl_en_2x2_converged pending RECORDS --seeds 1 --cells layernorm.dot layernorm.qknorm
        prints "NORM ATTENTION SEED" for every cell and seed whose run has not stopped yet
    python -m experiments.gl_en_2x2_converged run RECORDS --arm-dir DIR --norm N --attention A --seed S \\
            --data RAW --bin BIN --spm SPM.model -- fairseq-train ...
        trains (or resumes) one run and scores every validation's model on dev as training goes
    python -m experiments.gl_en_2x2_converged report RECORDS --data RAW
        writes RECORDS/README.md and its figures from runs.json

The stopping rule, the same for every run: fairseq-train saves a checkpoint at every validation
(every VALID_EPOCHS epochs); the driver translates dev with it (beam 4, length penalty 0.6, as the
test set is translated), undoes sentencepiece and scores it with sacrebleu (13a) against the plain
dev.en: the true dev BLEU. The run stops when the best of these has not improved for --patience
validations, or at --max-update updates. The checkpoint with the best true dev BLEU and the last
scored one are kept; the test set is translated with both.

fairseq-train itself runs unchanged, uninterrupted, with the recipe's schedule (its
reduce_lr_on_plateau steps on fairseq's own --eval-bleu, as in every recipe). The record, with
its dev curve so far, is rewritten after every validation (and committed with --commit), so a
measured point is never lost. Rerun, a run resumes from its checkpoint_last.pt; a run whose
checkpoints are gone (a new machine) restarts from its first update, its earlier curve kept in the
record as `lost_curves` (with the commit, resumes and CPUs that curve had), which the report counts.
The record names the CPU each stretch of training ran on (`cpus`: [updates, "model (kernels)"] wherever
it changed): the model name and torch's CPU kernel set (AVX2, AVX512), whose rounding decides the
floating-point results; machines sold under one model name ("AMD EPYC") may run different sets. Checkpoints live in
the run's folder (--arm-dir), which must be outside the repository: only records and hypotheses are
ever committed.
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from experiments.fairseq_logs import parse_train_log, train_loss_curve
from experiments.gl_en_2x2_records import (
    CELLS,
    SRC,
    TGT,
    data_sha1,
    hyp_name,
    learned_g,
    locked,
    portable_command,
    read_runs,
    write_runs,
)
from experiments.machine import cpu_with_kernels
from fairseq_qknorm_cli.files import fail, write_text

PATIENCE = 8
MAX_UPDATE = 13600
# Decoding as the recipes decode (examples/common.sh): beam 4, length penalty 0.6, source + 50 tokens.
DECODING = ["--beam", "4", "--lenpen", "0.6", "--max-len-a", "1", "--max-len-b", "50"]
BEST, LAST = "checkpoint_best_dev.pt", "checkpoint_last_scored.pt"
# How often the log is read for new checkpoints (a few hundred lines at most); an ended fairseq-train
# is noticed at once.
POLL_SECONDS = 2


def stop_reason(curve, patience, max_update):
    """Why a run with this dev curve ([[updates, dev BLEU, dev loss], ...]) stops now, or None.
    plateau: the best dev BLEU (its first occurrence) is `patience` or more validations old;
    cap: the last validation is at `max_update` updates or more."""
    if not curve:
        return None
    bleus = [b for _, b, _ in curve]
    best = bleus.index(max(bleus))
    if len(curve) - 1 - best >= patience:
        return "plateau"
    if curve[-1][0] >= max_update:
        return "cap"
    return None


def best_index(curve):
    bleus = [b for _, b, _ in curve]
    return bleus.index(max(bleus))


# ------------------------------------------------------------------ scoring
def translate(args, checkpoint, subset, env):
    """Detokenized translations of SUBSET (valid | test) by CHECKPOINT, in corpus order."""
    import sentencepiece as spm

    cmd = ["fairseq-generate", args.bin, "--user-dir", args.user_dir, "--path", checkpoint]
    cmd += ["--source-lang", SRC, "--target-lang", TGT, "--gen-subset", subset, *DECODING]
    cmd += ["--batch-size", "64", "--required-batch-size-multiple", "1", *args.device_flags]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"fairseq-generate on {checkpoint} ({subset}) failed: {out.stderr.strip()[-2000:]}")
    hyps = {}
    for line in out.stdout.splitlines():
        if line.startswith("H-"):
            idx, _, pieces = line[2:].split("\t", 2)
            hyps[int(idx)] = pieces
    sp = spm.SentencePieceProcessor(model_file=args.spm)
    return [sp.decode(hyps[i].split()) for i in range(len(hyps))]


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def dev_bleu(args, checkpoint, env):
    import sacrebleu

    refs = read_lines(os.path.join(args.data, f"dev.{TGT}"))
    hyps = translate(args, checkpoint, "valid", env)
    if len(hyps) != len(refs):
        raise RuntimeError(f"{checkpoint}: {len(hyps)} dev translations for {len(refs)} references")
    # force: the references are Moses-tokenized, as released (13a on them, as the 2x2 scores dev)
    return round(sacrebleu.corpus_bleu(hyps, [refs], force=True).score, 2)


def test_scores(args, checkpoint, env, hyp_path=None):
    """Test BLEU (sacrebleu --tokenize none on the Moses-tokenized release, the paper's tokenized
    BLEU) and chrF of CHECKPOINT; its translations go to HYP_PATH when given."""
    import sacrebleu

    refs = read_lines(os.path.join(args.data, f"test.{TGT}"))
    hyps = translate(args, checkpoint, "test", env)
    if len(hyps) != len(refs):
        raise RuntimeError(f"{checkpoint}: {len(hyps)} test translations for {len(refs)} references")
    if hyp_path:
        write_text(hyp_path, "".join(h + "\n" for h in hyps))
    bleu = sacrebleu.corpus_bleu(hyps, [refs], tokenize="none", force=True).score
    chrf = sacrebleu.corpus_chrf(hyps, [refs]).score
    return round(bleu, 2), round(chrf, 2)


# ------------------------------------------------------------------ fairseq-train's log and checkpoints
def checkpoint_state(path):
    from fairseq_qknorm_cli.inspect_checkpoints import load_checkpoint

    return load_checkpoint(path)


def position(state):
    """(updates, epochs) of a checkpoint, epochs counted as fairseq's log counts them ("Saved checkpoint
    ... (epoch E @ N updates)"): a save at the end of epoch E stores the iterator at epoch E + 1."""
    it = state["extra_state"]["train_iterator"]
    epoch = it["epoch"] - 1 if it["iterations_in_epoch"] == 0 else it["epoch"]
    return state["optimizer_history"][-1]["num_updates"], epoch


def lr_at(log_path):
    """{updates: learning rate} from fairseq-train's epoch-end train lines."""
    out = {}
    if os.path.exists(log_path):
        with open(log_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if "| train |" in line or "| INFO | train |" in line:
                    lr, updates = re.search(r"\| lr ([\d.e-]+)", line), re.search(r"\| num_updates (\d+)", line)
                    if lr and updates:
                        out[int(updates.group(1))] = float(lr.group(1))
    return out


def saved_checkpoints(log_path):
    """[(path, updates, epoch)] of the epoch checkpoints fairseq-train has finished saving, by its log
    (fairseq logs "Saved checkpoint" once every copy of the save is written), that are still there."""
    out = {}
    if os.path.exists(log_path):
        with open(log_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                m = re.search(r"Saved checkpoint (\S+) \(epoch (\d+) @ (\d+) updates", line)
                if m and re.fullmatch(r"checkpoint\d+\.pt", os.path.basename(m.group(1))):
                    out[m.group(1)] = (int(m.group(3)), int(m.group(2)))
    return sorted(((p, u, e) for p, (u, e) in out.items() if os.path.exists(p)), key=lambda x: x[1])


def git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def commit_records(records, message):
    """Commit RECORDS (this folder only: other changes of the tree are left alone), retried while
    another git command holds the index; a failure is logged, and the next commit takes it along."""
    for _ in range(10):
        git("add", "--", ".", cwd=records)
        done = git("commit", "-q", "-m", message, "--", ".", cwd=records)
        if done.returncode == 0 or "nothing to commit" in done.stdout + done.stderr:
            return
        time.sleep(5)
    log(f"warning: could not commit {records} ({message}); the next validation's commit takes it along")


def tracked_by_git(path):
    """Whether git would track PATH: it lies in a git work tree and no .gitignore covers it."""
    parent = os.path.abspath(path)
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    inside = git("rev-parse", "--is-inside-work-tree", cwd=parent).stdout.strip() == "true"
    return inside and git("check-ignore", "-q", os.path.abspath(path), cwd=parent).returncode != 0


def head_commit():
    """The commit of the code that runs (this file's checkout)."""
    return git("rev-parse", "--short", "HEAD", cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()


def log(message):
    print(f"| {time.strftime('%H:%M:%S', time.gmtime())} {message}", file=sys.stderr, flush=True)


def merged(old, new):
    """A curve ([[updates, value], ...]) from an earlier log and a later one: the later wins."""
    points = {u: v for u, v in old}
    points.update({u: v for u, v in new})
    return [[u, points[u]] for u in sorted(points)]


# ------------------------------------------------------------------ one run
class Run:
    def __init__(self, args):
        self.args = args
        self.key = (args.norm, args.attention, args.seed)
        self.name = f"{args.norm} + {args.attention}, seed {args.seed}"
        self.save_dir = os.path.join(args.arm_dir, "checkpoints")
        self.log_path = os.path.join(args.arm_dir, "train.log")
        self.env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))

    def load(self):
        with locked(self.args.records):
            found = [r for r in read_runs(self.args.records) if (r["norm"], r["attention"], r["seed"]) == self.key]
        return found[0] if found else None

    def save(self, entry, message=None):
        with locked(self.args.records):
            runs = read_runs(self.args.records)
            sha = data_sha1(self.args.data)
            if any(r.get("data_sha1") != sha for r in runs if (r["norm"], r["attention"], r["seed"]) != self.key):
                fail(
                    f"{self.args.data}: not the data of the runs in {self.args.records}/runs.json; use another RECORDS"
                )
            runs = [r for r in runs if (r["norm"], r["attention"], r["seed"]) != self.key]
            write_runs(self.args.records, runs + [entry])
        if message and self.args.commit:
            commit_records(self.args.records, message)

    def new_entry(self):
        a = self.args
        return {
            "norm": a.norm,
            "attention": a.attention,
            "seed": a.seed,
            "updates": 0,
            "epochs": 0,
            "stop_reason": "running",
            "patience": a.patience,
            "max_update": a.max_update,
            "dev_curve": [],
            "best_updates": None,
            "best_epoch": None,
            "test_bleu": None,
            "test_chrf": None,
            "last_test_bleu": None,
            "last_test_chrf": None,
            "hyp": None,
            "lr_curve": [],
            "train_loss": [],
            "g": {},
            "resumed_at_updates": [],
            "lost_curves": [],
            "cpus": [],
            "train_command": portable_command(" ".join(a.train_command), a.arm_dir),
            "commit": head_commit(),
            "threads": a.threads,
            "train_seconds": 0,
            "preset": a.preset,
            "data_sha1": data_sha1(a.data),
        }

    def run(self):
        a = self.args
        entry = self.load()
        if entry and entry["stop_reason"] != "running":
            log(f"{self.name}: stopped before ({entry['stop_reason']} at {entry['updates']} updates), skipped")
            return
        entry = entry or self.new_entry()
        resumable = os.path.exists(os.path.join(self.save_dir, "checkpoint_last.pt"))
        if not resumable:
            shutil.rmtree(a.arm_dir, ignore_errors=True)
        if entry["dev_curve"] and not resumable:
            # what describes the curve so far goes with it; the record's own fields describe the new one
            lost = ("dev_curve", "train_seconds", "commit", "resumed_at_updates", "cpus")
            entry["lost_curves"].append(
                {**{k: entry[k] for k in lost if k in entry}, "note": "checkpoints lost; restarted from scratch"}
            )
            log(
                f"{self.name}: its checkpoints are gone; restarting from scratch (its curve so far kept in lost_curves)"
            )
            entry.update(
                dev_curve=[],
                best_updates=None,
                best_epoch=None,
                lr_curve=[],
                train_loss=[],
                updates=0,
                epochs=0,
                train_seconds=0,
                commit=head_commit(),
                resumed_at_updates=[],
                cpus=[],
            )
        os.makedirs(self.save_dir, exist_ok=True)
        entry["train_command"] = portable_command(" ".join(a.train_command), a.arm_dir)
        self.save(entry)

        reason = stop_reason(entry["dev_curve"], a.patience, a.max_update)
        if reason is None:
            reason = self.train(entry)
        self.finish(entry, reason)

    def train(self, entry):
        """Run fairseq-train, scoring each validation's checkpoint as it appears, until the rule
        stops the run or fairseq-train ends."""
        a = self.args
        last = os.path.join(self.save_dir, "checkpoint_last.pt")
        from_updates = 0
        if os.path.exists(last):  # fairseq-train resumes from it
            from_updates = checkpoint_state(last)["optimizer_history"][-1]["num_updates"]
            entry["resumed_at_updates"].append(from_updates)
        cpus, cpu = entry.setdefault("cpus", []), cpu_with_kernels()  # records from before it have no cpus
        if not cpus or cpus[-1][1] != cpu:
            cpus.append([from_updates, cpu])
        log(f"{self.name}: fairseq-train {'resumes' if os.path.exists(last) else 'starts'} (log: {self.log_path})")
        started = time.time()
        seconds_before = entry["train_seconds"]
        with open(self.log_path, "a", encoding="utf-8") as train_log:
            proc = subprocess.Popen(a.train_command, env=self.env, stdout=train_log, stderr=subprocess.STDOUT)
        reason = None
        try:
            while reason is None:
                finished = proc.poll() is not None
                for checkpoint, updates, epoch in saved_checkpoints(self.log_path):
                    entry["train_seconds"] = seconds_before + round(time.time() - started)
                    reason = self.score_validation(entry, checkpoint, updates, epoch)
                    if reason:
                        break
                if reason or finished:
                    break
                try:
                    proc.wait(timeout=POLL_SECONDS)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        entry["train_seconds"] = seconds_before + round(time.time() - started)
        if reason:
            return reason
        if proc.returncode != 0:
            self.save(entry)
            fail(f"{self.name}: fairseq-train failed with exit status {proc.returncode} (log: {self.log_path})")
        # fairseq-train ended by itself: at --max-update (mid-epoch: only checkpoint_last.pt) or --stop-min-lr.
        last = os.path.join(self.save_dir, "checkpoint_last.pt")
        state = checkpoint_state(last)
        updates, epoch = position(state)
        if updates not in {u for u, _, _ in entry["dev_curve"]}:
            shutil.copyfile(last, os.path.join(self.save_dir, "checkpoint_end.pt"))
            self.score_validation(entry, os.path.join(self.save_dir, "checkpoint_end.pt"), updates, epoch)
        return stop_reason(entry["dev_curve"], a.patience, a.max_update) or "min_lr"

    def score_validation(self, entry, checkpoint, updates, epoch):
        """Score one validation's checkpoint on dev, add it to the curve, keep it if best, rewrite the
        record; returns the stopping rule's verdict."""
        a = self.args
        if updates not in {u for u, _, _ in entry["dev_curve"]}:
            bleu = dev_bleu(a, checkpoint, self.env)
            loss = {u: dev_loss for u, dev_loss, _ in parse_train_log(self.log_path)["dev"]}.get(updates)
            entry["dev_curve"].append([updates, bleu, loss])
            entry["dev_curve"].sort()
            lrs = lr_at(self.log_path)
            entry["lr_curve"] = merged(entry["lr_curve"], [[u, lrs[u]] for u in sorted(lrs)])
            entry["updates"], entry["epochs"] = updates, epoch
            if best_index(entry["dev_curve"]) == len(entry["dev_curve"]) - 1:
                entry["best_updates"], entry["best_epoch"] = updates, epoch
                shutil.copyfile(checkpoint, os.path.join(self.save_dir, BEST + ".tmp"))
                os.replace(os.path.join(self.save_dir, BEST + ".tmp"), os.path.join(self.save_dir, BEST))
            os.replace(checkpoint, os.path.join(self.save_dir, LAST))
            entry["train_loss"] = merged(entry["train_loss"], train_loss_curve(self.log_path))
            best = entry["dev_curve"][best_index(entry["dev_curve"])]
            summary = f"{self.name}: {updates} updates, dev BLEU {bleu:.2f} (best {best[1]:.2f} at {best[0]})"
            log(summary)
            self.save(entry, f"gl-en 2x2 converged, {summary}")
        else:
            os.remove(checkpoint)
        return stop_reason(entry["dev_curve"], a.patience, a.max_update)

    def finish(self, entry, reason):
        a = self.args
        best, last = os.path.join(self.save_dir, BEST), os.path.join(self.save_dir, LAST)
        for path in (best, last):
            if not os.path.exists(path):
                fail(f"{self.name}: {path} is missing; cannot score the stopped run (delete its record to retrain)")
        log(f"{self.name}: stopped ({reason}) at {entry['updates']} updates; translating test")
        hyp = hyp_name(a.norm, a.attention, a.seed)
        entry["test_bleu"], entry["test_chrf"] = test_scores(a, best, self.env, os.path.join(a.records, hyp))
        entry["last_test_bleu"], entry["last_test_chrf"] = test_scores(a, last, self.env)
        entry.update(hyp=hyp, stop_reason=reason, g=learned_g(best))
        entry["train_loss"] = merged(entry["train_loss"], train_loss_curve(self.log_path))
        for checkpoint, _, _ in saved_checkpoints(self.log_path):  # saved after the stopping validation
            os.remove(checkpoint)
        summary = (
            f"{self.name}: stopped ({reason}) at {entry['updates']} updates; best dev BLEU at "
            f"{entry['best_updates']}: test BLEU {entry['test_bleu']:.2f}, chrF {entry['test_chrf']:.2f}"
        )
        log(summary)
        self.save(entry, f"gl-en 2x2 converged, {summary}")


def pending(records, seeds, cells):
    stopped = {(r["norm"], r["attention"], r["seed"]) for r in read_runs(records) if r["stop_reason"] != "running"}
    return [(n, a, s) for s in seeds for n, a in cells if (n, a, s) not in stopped]


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m experiments.gl_en_2x2_converged",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pending")
    p.add_argument("records")
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    p.add_argument("--cells", nargs="+", default=[f"{n}.{a}" for n, a in CELLS], help="NORM.ATTENTION, in order")
    r = sub.add_parser("run")
    r.add_argument("records")
    r.add_argument("--arm-dir", required=True)
    r.add_argument("--norm", choices=("scalenorm", "layernorm"), required=True)
    r.add_argument("--attention", choices=("dot", "qknorm"), required=True)
    r.add_argument("--seed", type=int, required=True)
    r.add_argument("--data", required=True, help="the plain-text corpus: {train,dev,test}.{gl,en}")
    r.add_argument("--bin", required=True, help="fairseq-preprocess's output (valid and test subsets)")
    r.add_argument("--spm", required=True, help="the sentencepiece model the data was encoded with")
    r.add_argument("--user-dir", required=True)
    r.add_argument("--device-flags", default="--cpu", help="as the recipe passes them (default: --cpu)")
    r.add_argument("--preset", default="cpu")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument(
        "--patience", type=int, default=PATIENCE, help=f"validations without a better dev BLEU (default {PATIENCE})"
    )
    r.add_argument("--max-update", type=int, default=MAX_UPDATE, help=f"the cap in updates (default {MAX_UPDATE})")
    r.add_argument("--commit", action="store_true", help="git-commit RECORDS after every validation")
    t = sub.add_parser("report")
    t.add_argument("records")
    t.add_argument("--data", required=True)
    argv = sys.argv[1:] if argv is None else list(argv)
    # run: everything after "--" is the recipe's fairseq-train command
    train = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.train_command = train
    if args.command == "pending":
        cells = []
        for cell in args.cells:
            if tuple(cell.split(".")) not in CELLS:
                fail(
                    f"--cells: unknown cell '{cell}' (expected NORM.ATTENTION, one of {', '.join(f'{n}.{a}' for n, a in CELLS)})"
                )
            cells.append(tuple(cell.split(".")))
        for norm, attention, seed in pending(args.records, args.seeds, cells):
            print(norm, attention, seed)
    elif args.command == "run":
        if not args.train_command:
            fail("run: give the fairseq-train command after --")
        if tracked_by_git(args.arm_dir):
            fail(f"--arm-dir {args.arm_dir}: git would track its checkpoints; give a folder outside the repository")
        args.device_flags = args.device_flags.split()
        os.makedirs(args.records, exist_ok=True)
        Run(args).run()
    else:
        from experiments.gl_en_2x2_converged_report import write_report

        write_report(args.records, args.data)


if __name__ == "__main__":
    main()
