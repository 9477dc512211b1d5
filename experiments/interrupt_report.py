"""The report of examples/interrupt/run.sh: what each kill did, and the final models of both arms.

python -m experiments.interrupt_report files ARM_DIR   every checkpoint file of an arm, complete or not
python -m experiments.interrupt_report report WORK     WORK/interrupt.{json,md} from the attempts'
                                                       records and both arms' logs and checkpoints
"""

import argparse
import json
import pathlib
import re
import statistics
import zipfile

from experiments.fairseq_logs import parse_valid_line
from fairseq_qknorm_cli.files import fail, write_text


def checkpoint_files(arm):
    """One line per checkpoint file of ARM (checkpoints.tmp/ and checkpoints/): name, size, and
    whether it is a whole zip archive as torch.save writes it."""
    lines = []
    for d in ("checkpoints.tmp", "checkpoints"):
        for p in sorted((pathlib.Path(arm) / d).glob("checkpoint*")):
            ok = zipfile.is_zipfile(p) and zipfile.ZipFile(p).testzip() is None
            lines.append(f"{d}/{p.name} {p.stat().st_size} {'complete' if ok else 'truncated'}")
    return lines


def faults(kill_after):
    return {
        1: "kill -9 half-way through the first checkpoint copy",
        2: f"kill -9 mid-epoch, {kill_after} updates after the resume",
        3: "kill -9 half-way through the first torch.save",
        4: "none",
    }


def validations(text):
    """[updates, dev BLEU] of the validations the final model descends from: a resume from a
    checkpoint of U updates drops the validations after U of the attempt that was killed."""
    kept = []
    for line in text.splitlines():
        loaded = re.search(r"Loaded checkpoint \S+ \(epoch \d+ @ (\d+) updates\)", line)
        if loaded:
            kept = [v for v in kept if v[0] <= int(loaded[1])]
        valid = parse_valid_line(line)
        if valid:
            kept.append([valid[0], valid[2]])
    return kept


def parse(text):
    updates = [int(u) for u in re.findall(r"num_updates[= ](\d+)", text)]
    loaded = re.search(r"Loaded checkpoint (\S+) \(epoch (\d+) @ (\d+) updates\)", text)
    saved = re.findall(r"Saved checkpoint \S+ \(epoch (\d+) @ (\d+) updates", text)
    valid = [v for v in map(parse_valid_line, text.splitlines()) if v]
    epoch = re.search(r"epoch \d+: +\d+ / +(\d+)", text)
    return {
        "last_logged_updates": max(updates, default=0),
        "resumed_from": loaded
        and {"file": pathlib.Path(loaded[1]).name, "epoch": int(loaded[2]), "updates": int(loaded[3])},
        "fresh_start": "No existing checkpoint found" in text,
        "last_saved_updates": int(saved[-1][1]) if saved else None,
        "dev_bleu": [[updates, bleu] for updates, _, bleu in valid],
        "updates_per_epoch": int(epoch[1]) if epoch else None,
    }


def run_summary(work, arm):
    text = (arm / "train.log").read_text()
    dev = validations(text)
    seconds = work / f"{arm.name}.seconds"
    return {
        "final_updates": parse(text)["last_logged_updates"],
        "dev_bleu_final": dev[-1][1],
        "dev_bleu_best": max(b for _, b in dev),
        "dev_bleu": dev,
        "seconds": int(seconds.read_text()) if seconds.exists() else None,
    }


def report(work):
    import torch

    import fairseq_qknorm  # noqa: F401  (allow-lists what fairseq checkpoints hold for the safe loader)

    seeds = {}
    for out in sorted(work.glob("attempts/seed*"), key=lambda d: int(d.name[4:])):
        seed = int(out.name[4:])
        if not (out / "4.rc").exists():
            continue  # an experiment still running, or cut short
        kill_after = int((out / "kill_after").read_text())
        attempts = []
        for n in (1, 2, 3, 4):
            entry = {
                "attempt": n,
                "fault": faults(kill_after)[n],
                "rc": int((out / f"{n}.rc").read_text()),
                "files": (out / f"{n}.files").read_text().split("\n")[:-1],
                **parse((out / f"{n}.log").read_text()),
            }
            if n > 1:  # the work of the attempt before that this one does not start from
                entry["updates_lost"] = (
                    attempts[-1]["last_logged_updates"] - (entry["resumed_from"] or {"updates": 0})["updates"]
                )
            attempts.append(entry)
        arms = {name: work / f"arms/{name}-seed{seed}" for name in ("uninterrupted", "interrupted")}
        states = [
            torch.load(arm / "checkpoints/checkpoint_last.pt", weights_only=True)["model"] for arm in arms.values()
        ]
        seeds[seed] = {
            "attempts": attempts,
            "kill_after": kill_after,
            **{name: run_summary(work, arm) for name, arm in arms.items()},
            "max_abs_weight_difference": max(
                (states[0][k].float() - states[1][k].float()).abs().max().item() for k in states[0]
            ),
        }
    if not seeds:
        fail(f"{work}/attempts: no finished experiment to report")

    bleu = {name: [s[name]["dev_bleu_final"] for s in seeds.values()] for name in ("uninterrupted", "interrupted")}
    differences = [i - u for u, i in zip(bleu["uninterrupted"], bleu["interrupted"])]
    summary = {
        "seeds": list(seeds),
        "mean_difference": statistics.mean(differences),
        "uninterrupted_range": [min(bleu["uninterrupted"]), max(bleu["uninterrupted"])],
    }
    if len(seeds) > 1:
        summary["uninterrupted_sd"] = statistics.stdev(bleu["uninterrupted"])
        summary["difference_sd"] = statistics.stdev(differences)
    write_text(str(work / "interrupt.json"), json.dumps({"seeds": seeds, "summary": summary}, indent=1) + "\n")

    md = [
        "| seed | attempt | fault | exit | resumed from | updates lost | log reached | files after (final names) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for seed, s in seeds.items():
        for a in s["attempts"]:
            r = a["resumed_from"]
            resumed = (
                f"{r['file']} (epoch {r['epoch']} @ {r['updates']})"
                if r
                else ("nothing (fresh start)" if a["fresh_start"] else "-")
            )
            files = ", ".join(f for f in a["files"] if ".tmp " not in f.replace("checkpoints.tmp/", ""))
            md.append(
                f"| {seed} | {a['attempt']} | {a['fault']} | {a['rc']} | {resumed} | {a.get('updates_lost', '-')} | "
                f"{a['last_logged_updates']} | {files} |"
            )
    md += [
        "",
        "| seed | updates | final dev BLEU, uninterrupted | interrupted | difference | best dev BLEU, uninterrupted | "
        "interrupted | max \\|weight difference\\| | wall (s), uninterrupted | interrupted (4 attempts) |",
        "|" + "---|" * 10,
    ]
    for seed, s in seeds.items():
        u, i = s["uninterrupted"], s["interrupted"]
        wall = [str(r["seconds"]) if r["seconds"] is not None else "-" for r in (u, i)]
        md.append(
            f"| {seed} | {i['final_updates']} | {u['dev_bleu_final']:.2f} | {i['dev_bleu_final']:.2f} | "
            f"{i['dev_bleu_final'] - u['dev_bleu_final']:+.2f} | {u['dev_bleu_best']:.2f} | {i['dev_bleu_best']:.2f} | "
            f"{s['max_abs_weight_difference']:.3g} | {wall[0]} | {wall[1]} |"
        )
    md.append("")
    md.append(
        f"interrupted minus uninterrupted final dev BLEU, mean over {len(seeds)} seed(s): {summary['mean_difference']:+.2f}"
        + (
            f" (sd {summary['difference_sd']:.2f}); between seeds, uninterrupted: {summary['uninterrupted_range'][0]:.2f} "
            f"to {summary['uninterrupted_range'][1]:.2f} (sd {summary['uninterrupted_sd']:.2f})"
            if len(seeds) > 1
            else ""
        )
    )
    write_text(str(work / "interrupt.md"), "\n".join(md) + "\n")
    print("\n".join(md))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m experiments.interrupt_report", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("files").add_argument("arm", type=pathlib.Path)
    sub.add_parser("report").add_argument("work", type=pathlib.Path)
    args = parser.parse_args(argv)
    if args.command == "files":
        print("\n".join(checkpoint_files(args.arm)))
    else:
        report(args.work)


if __name__ == "__main__":
    main()
