"""What fairseq-train's log says (--log-format simple): the one parser of its lines that the
recipes, reports and figures share."""

import re


def parse_valid_line(line):
    """(updates, dev loss or None, dev BLEU) from fairseq-train's `valid` line with --eval-bleu, else None."""
    if "valid on 'valid' subset" not in line:
        return None
    bleu = re.search(r"\| bleu ([\d.]+)", line)
    updates = re.search(r"\| num_updates (\d+)", line)
    if not (bleu and updates):
        return None
    loss = re.search(r"\| loss ([\d.]+)", line)
    return int(updates.group(1)), float(loss.group(1)) if loss else None, float(bleu.group(1))


def parse_train_log(path):
    """What fairseq-train's simple-format log says: parameters, updates, dev BLEU per validation
    (dev_bleu: [updates, BLEU]; dev: [updates, loss, BLEU]), why training stopped, and the plugin's
    L and g0 when `--qk-scale-init auto` resolved them, and the updates at which a restarted
    fairseq-train resumed from its checkpoint_last.pt (resumed_at)."""
    out = {
        "params": None,
        "updates": None,
        "dev_bleu": [],
        "dev": [],
        "best_dev_bleu": None,
        "stopped_by": None,
        "L": None,
        "g0": None,
        "resumed_at": [],
    }
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = re.search(r"num\. (?:shared )?model params: ([\d,]+)", line)
            if m:
                out["params"] = int(m.group(1).replace(",", ""))
            valid = parse_valid_line(line)
            if valid:
                out["dev_bleu"].append([valid[0], valid[2]])
                out["dev"].append(list(valid))
                out["best_dev_bleu"] = max(b for _, b in out["dev_bleu"])
            m = re.search(r"num_updates[ =](\d+)", line)
            if m:
                out["updates"] = int(m.group(1))
            m = re.search(r"qk-norm: L=(\d+) .* g0=log2\(L\^2-L\)=([\d.]+)", line)
            if m:
                out["L"], out["g0"] = int(m.group(1)), float(m.group(2))
            m = re.search(r"Loaded checkpoint .* \(epoch \d+ @ (\d+) updates\)", line)
            if m and int(m.group(1)) > 0:
                out["resumed_at"].append(int(m.group(1)))
            if "stopping training" in line.lower():  # --stop-min-lr, --stop-time-hours, --patience
                out["stopped_by"] = line.split("|")[-1].strip()
    return out


def train_loss_curve(path):
    """[[updates, training loss]] from fairseq-train's train_inner lines. A resumed run logs some
    updates twice: the later line is the one on the path to the final model."""
    by_update = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if "| train_inner |" in line:
                loss, updates = re.search(r" loss=([\d.]+)", line), re.search(r"num_updates=(\d+)", line)
                if loss and updates:
                    by_update[int(updates.group(1))] = float(loss.group(1))
    return [[u, by_update[u]] for u in sorted(by_update)]
