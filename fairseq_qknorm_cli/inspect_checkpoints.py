"""fairseq-qknorm-inspect: look inside trained checkpoints.

  fairseq-qknorm-inspect g CKPT [CKPT ...]                  every learned temperature g, against g0 and 10-25
  fairseq-qknorm-inspect stats CKPT [CKPT2] --data BIN      attention entropy, max weight, saturation, logits
  fairseq-qknorm-inspect heatmaps CKPT [CKPT2] --sentence TEXT --spm SPM --png-dir DIR   attention heatmaps
  fairseq-qknorm-inspect g-history CKPT_DIR --png-dir DIR   g over training

`g` reads only the checkpoint (no data, no model built). `stats` and `heatmaps` load the model(s)
through fairseq and run them in eval mode with teacher forcing. Every table and figure names each
system from its checkpoint's config ("baseline: ScaleNorm, scaled dot product", "QKNorm: LayerNorm,
l2 + learned g"); --labels NAME ... replaces those names.
"""

import argparse
import glob
import json
import math
import os
import statistics
import warnings

from .files import fail
from .logs import setup_logging

G_SUFFIX = ".qk_scale.g"
G_RANGE = (10.0, 25.0)  # g read off trained QKNorm heads by Bricken & Pehlevan (2021)
NORM_NAMES = {"layernorm": "LayerNorm", "scalenorm": "ScaleNorm"}


# ----------------------------------------------------------------------------- checkpoints


def load_checkpoint(path):
    """The checkpoint as a dict, loaded as the plugin has fairseq load checkpoints: torch's safe
    unpickler with fairseq's few non-tensor classes allow-listed, unless the user named the file
    as trusted."""
    from fairseq_qknorm.fairseq_patches import load_checkpoint_safely

    try:
        state = load_checkpoint_safely(path, map_location="cpu")
    except Exception as e:  # a truncated file, not a checkpoint, or a class outside the allow-list
        fail(f"{path}: cannot be read as a fairseq checkpoint ({str(e).strip().splitlines()[0]})")
    if not isinstance(state, dict) or "model" not in state:
        fail(f"{path}: not a fairseq checkpoint (no 'model' state dict)")
    return state


def model_config(state):
    cfg = state.get("cfg")
    return cfg["model"] if cfg is not None and cfg.get("model") is not None else state.get("args")


def num_updates(state):
    history = state.get("optimizer_history") or [{}]
    return history[-1].get("num_updates")


def system_name(model_cfg):
    """What a reader compares, from the model config: "baseline: ScaleNorm, scaled dot product",
    "QKNorm: LayerNorm, l2 + learned g". fairseq's stock transformer has none of these options:
    LayerNorm and scaled dot product."""
    qk_norm = getattr(model_cfg, "qk_norm", None) or "none"
    qk_scale = getattr(model_cfg, "qk_scale", None) or "none"
    norm = getattr(model_cfg, "norm_type", None) or "layernorm"
    norm = NORM_NAMES.get(norm, norm)
    if qk_scale == "none":
        if qk_norm == "none":
            return f"baseline: {norm}, scaled dot product"
        return f"QKNorm: {norm}, {qk_norm}, scaled dot product"
    per_head = " per head" if getattr(model_cfg, "qk_scale_per_head", False) else ""
    return f"QKNorm: {norm}, {qk_norm} + {qk_scale} g{per_head}"


def distinct_parts(paths):
    """The part of each path that tells it from the others: "baseline" and "qknorm" for
    runs/baseline/checkpoints/checkpoint_best.pt and runs/qknorm/checkpoints/checkpoint_best.pt.
    A single path (or the same one twice) is kept whole."""
    split = [os.path.normpath(p).split(os.sep) for p in paths]
    if len({tuple(s) for s in split}) < 2:
        return list(paths)
    head = len(os.path.commonprefix(split))
    tail = len(os.path.commonprefix([s[::-1] for s in split]))
    tail = min(tail, min(map(len, split)) - head - 1)  # each keeps at least one component
    return [os.sep.join(s[head : len(s) - tail]) for s in split]


def temperatures(path, state, name=None):
    """Every g of one checkpoint, with its g0 and L, as a JSON-ready dict; name: the system's
    name (default: from the checkpoint's config). "g" is empty for a checkpoint without one
    (fairseq's stock attention, --qk-scale none)."""
    from fairseq_qknorm.qk_flags import norm_length2

    from .attention_stats import attention_module, sort_key

    cfg = model_config(state)
    found = {
        "checkpoint": path,
        "name": name or system_name(cfg),
        "arch": getattr(cfg, "arch", None),
        "num_updates": num_updates(state),
        "qk_norm": getattr(cfg, "qk_norm", None),
        "qk_scale": getattr(cfg, "qk_scale", None),
    }
    rows = []
    for key, value in state["model"].items():
        if not key.endswith(G_SUFFIX):
            continue
        where = attention_module(key[: -len(G_SUFFIX)])
        if where is None:
            fail(f"{path}: {key} is not in an encoder or decoder layer's self_attn / encoder_attn")
        values = value.float().flatten().tolist()
        per_head = value.dim() > 0
        for head, g in enumerate(values):
            rows.append({"module": where[0], "layer": where[1], "head": head if per_head else None, "g": g})
    if not rows:
        return {**found, "g": []}
    rows.sort(key=lambda r: (sort_key((r["module"], r["layer"])), r["head"] or 0))
    g0 = getattr(cfg, "qk_scale_init", None)
    g0 = float(g0) if isinstance(g0, (int, float)) else None  # 'auto' only in pre-build configs
    per = norm_length2(cfg)  # g0 is log2(L^2 - L) over it (qk_flags.for_the_norm)
    gs = [r["g"] for r in rows]
    low, high = g_range(per)
    return {
        **found,
        "per_head": rows[0]["head"] is not None,
        "g0": g0,
        "L": sentence_length(g0, cfg, per),
        "norm_length2": per,
        "g": rows,
        "summary": {
            "count": len(gs),
            "min": min(gs),
            "median": statistics.median(gs),
            "max": max(gs),
            "below": sum(g < low for g in gs),
            "within": sum(low <= g <= high for g in gs),
            "above": sum(g > high for g in gs),
        },
    }


def without_g(t):
    """What to say of a checkpoint without a temperature g (temperatures' "g" empty)."""
    return (
        f"{t['checkpoint']} has no QKNorm temperature g (no '*{G_SUFFIX}' parameter; arch {t['arch']}, "
        f"{t['name']}); `fairseq-qknorm-inspect stats` gives attention statistics for any checkpoint"
    )


def sentence_length(g0, cfg, per):
    """The L whose log2(L^2 - L) is g0 times PER (norm_length2: head_dim for LayerNorm and RMSNorm),
    for a learned g on normalized q and k; None where no sentence length gives g0 (a g0 below that of
    L = 2, or beyond any length: a number passed as --qk-scale-init)."""
    from fairseq_qknorm.length_prior import length_from_g0

    if g0 is None or getattr(cfg, "qk_scale", None) != "learned" or getattr(cfg, "qk_norm", "l2") == "none" or not per:
        return None
    length = length_from_g0(g0 * per)
    return length if g0 * per >= 1 and length < 1e9 else None  # no sentence is a billion tokens long (nor inf)


def print_temperatures(t):
    if not t["g"]:  # among several checkpoints (one alone is an error)
        print(f"{t['name']} ({t['checkpoint']}): {t['arch']}, {t['num_updates']} updates")
        print(without_g(t))
        return
    g0 = t["g0"]
    print(
        f"{t['name']} ({t['checkpoint']}): {t['arch']}, {t['num_updates']} updates, "
        f"one g per {'head' if t['per_head'] else 'attention module'}"
    )
    if t["qk_scale"] == "fixed":  # a constant, not derived from a length: nothing learned to show
        print(f"g = {g0:.4f} in every module, fixed (--qk-scale fixed --qk-scale-init {g0:g}): not learned")
        return
    if t["L"] is not None:
        per = (
            ""
            if t["norm_length2"] == 1
            else f"/{t['norm_length2']} (head_dim: the length^2 of a {t['qk_norm']} output)"
        )
        print(f"g0 = {g0:.4f} = log2(L^2 - L){per}, L = {t['L']:.0f}")
    elif g0 is not None:
        print(f"g0 = {g0:.4g} (log2(L^2 - L) of no sentence length L)" if t["qk_norm"] != "none" else f"g0 = {g0:.4g}")
    rows = [["module", "layer", "head", "g", "g - g0"]]
    for r in t["g"]:
        rows.append(
            [
                r["module"],
                str(r["layer"]),
                "-" if r["head"] is None else str(r["head"]),
                f"{r['g']:.4f}",
                "-" if g0 is None else f"{r['g'] - g0:+.4f}",
            ]
        )
    print_table(rows, left=2)
    print(summary_line(t))


def summary_line(t):
    s = t["summary"]
    per = t["norm_length2"]
    low, high = g_range(per)
    start = "" if t["g0"] is None else f", g0 {t['g0']:.2f}"
    over = "" if per == 1 else f" over head_dim {per}"
    return (
        f"summary: {s['count']} g from {s['min']:.4g} to {s['max']:.4g} (median {s['median']:.4g}{start}); "
        f"{s['within']} of {s['count']} within {low:g}-{high:g}, the range Bricken & Pehlevan read off "
        f"trained QKNorm heads{over} ({s['below']} below, {s['above']} above)"
    )


def g_range(per):
    """G_RANGE for a g on vectors of squared length PER (norm_length2); NaN where that is unknown."""
    return tuple(x / per for x in G_RANGE) if per else (math.nan, math.nan)


def print_table(rows, left):
    """Aligned columns; the first `left` columns left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        print("  ".join(cells).rstrip())


# ----------------------------------------------------------------------------- models


def load_model(path, data, device):
    """(model in eval mode, its config, task) through fairseq's own loader; data overrides the
    checkpoint's data path."""
    from fairseq import checkpoint_utils

    import fairseq_qknorm  # noqa: F401  registers the model and allow-lists checkpoint classes

    try:
        models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
            [path], arg_overrides={"data": data} if data is not None else None
        )
    except FileNotFoundError as e:
        where = "--data" if data is not None else f"{path} (its training data; pass --data)"
        fail(f"{where}: {e}")
    return models[0].to(device).eval(), cfg.model, task


def subset_statistics(model, task, subset, max_tokens):
    """{(kind, layer): AttentionStats} over every sentence pair of the subset, and its size."""
    from fairseq import utils

    from .attention_stats import forward_with_stats

    try:
        task.load_dataset(subset)
    except FileNotFoundError as e:
        fail(f"--subset {subset}: {e}")
    dataset = task.dataset(subset)
    warnings.filterwarnings("ignore", message=".*'pin_memory' argument is set as true")  # fairseq's loader, CPU
    batches = task.get_batch_iterator(
        dataset=dataset,
        max_tokens=max_tokens,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        required_batch_size_multiple=1,  # the default 8 silently drops the last batch
    ).next_epoch_itr(shuffle=False)
    device = next(model.parameters()).device
    stats, sentences = {}, 0
    for batch in batches:
        batch = utils.move_to_cuda(batch, device=device) if device.type == "cuda" else batch
        net = batch["net_input"]
        forward_with_stats(
            model, stats, net["src_tokens"], net["src_lengths"], net["prev_output_tokens"], task.target_dictionary.pad()
        )
        sentences += batch["nsentences"]
    if sentences != len(dataset):
        fail(f"--subset {subset}: saw {sentences} of {len(dataset)} sentence pairs (longer than the model allows?)")
    return stats, sentences


def attention_report(args, device):
    from .attention_stats import SATURATION, sort_key

    runs = []
    for index, path in enumerate(args.checkpoints):
        model, cfg, task = load_model(path, args.data, device)
        stats, sentences = subset_statistics(model, task, args.subset, args.max_tokens)
        runs.append(
            {
                "checkpoint": path,
                "name": args.labels[index] if args.labels else system_name(cfg),
                "arch": getattr(cfg, "arch", None),
                "sentences": sentences,
                "modules": [{"module": w[0], "layer": w[1], **stats[w].summary()} for w in sorted(stats, key=sort_key)],
            }
        )
    return {"data": args.data, "subset": args.subset, "saturation_threshold": SATURATION, "checkpoints": runs}


def print_attention(report):
    runs = report["checkpoints"]
    print(
        f"attention on '{report['subset']}' of {report['data']}: {runs[0]['sentences']} sentence pairs, "
        "eval mode, teacher forcing"
    )
    print(
        "per module, over heads and query rows (real tokens with at least two keys to choose from): mean "
        "entropy (nats), mean maximum weight (max w), share of rows with maximum weight > "
        f"{report['saturation_threshold']:g} (saturated), range of the pre-softmax logits"
    )
    for index, run in enumerate(runs, 1):
        print(f"[{index}] {run['name']} ({run['checkpoint']}, {run['arch']})")
    keys = []
    for run in runs:
        keys += [(m["module"], m["layer"]) for m in run["modules"] if (m["module"], m["layer"]) not in keys]
    columns = ["entropy", "max w", "saturated", "logits"]
    group = [""] * 2
    for index in range(1, len(runs) + 1):
        group += [f"[{index}]"] + [""] * (len(columns) - 1)
    rows = [group, ["module", "layer"] + columns * len(runs)]
    for key in keys:
        row = [key[0], str(key[1])]
        for run in runs:
            m = next((m for m in run["modules"] if (m["module"], m["layer"]) == key), None)
            row += (
                ["-"] * len(columns)
                if m is None
                else [
                    f"{m['entropy']:.3f}",
                    f"{m['max_weight']:.3f}",
                    f"{100 * m['saturated']:.1f}%",
                    f"{m['logit_min']:.2f} .. {m['logit_max']:.2f}",
                ]
            )
        rows.append(row)
    print_table(rows, left=2)


# ----------------------------------------------------------------------------- heatmaps


def encode(sp, dictionary, text):
    """Text -> token ids with </s>, through the sentencepiece model and the model's dictionary."""
    return dictionary.encode_line(
        " ".join(sp.encode(text, out_type=str)), add_if_not_exist=False, append_eos=True
    ).long()


def greedy_translation(model, src_tokens, dictionary):
    """Target ids ending in </s>, by greedy search: at each step the full prefix is run again
    (no incremental state), which is plenty fast for one sentence."""
    import torch

    eos = dictionary.eos()
    tokens = [eos]
    max_len = min(2 * len(src_tokens) + 10, model.max_decoder_positions() - 1)
    lengths = torch.tensor([len(src_tokens)], device=src_tokens.device)
    with torch.no_grad():
        while len(tokens) <= max_len and (len(tokens) == 1 or tokens[-1] != eos):
            logits, _ = model(src_tokens[None], lengths, torch.tensor([tokens], device=src_tokens.device))
            step = logits[0, -1].float()
            step[[dictionary.pad(), dictionary.bos()]] = float("-inf")
            tokens.append(int(step.argmax()))
    if tokens[-1] != eos:
        tokens.append(eos)
    return torch.tensor(tokens[1:], device=src_tokens.device)


def heatmaps(args, device):
    import sentencepiece as spm
    import torch

    from . import plots
    from .attention_stats import KINDS, sentence_attention

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    loaded = [load_model(path, args.data, device) for path in args.checkpoints]
    names = args.labels or [system_name(cfg) for _, cfg, _ in loaded]
    # Panel titles: the name, and the part of the path that tells the checkpoints apart.
    labels = [f"{name}\n{part}" for name, part in zip(names, distinct_parts(args.checkpoints))]
    target_text, target_from = args.target, "given"
    if target_text is None:  # the first checkpoint's greedy translation, the same target for all
        model, _, task = loaded[0]
        src = encode(sp, task.source_dictionary, args.sentence).to(device)
        out = greedy_translation(model, src, task.target_dictionary)
        target_text = sp.decode([task.target_dictionary[i] for i in out[:-1].tolist()])
        target_from = f"greedy translation by {names[0]}"
    maps = []
    for model, _, task in loaded:
        src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
        src, tgt = encode(sp, src_dict, args.sentence).to(device), encode(sp, tgt_dict, target_text).to(device)
        prev = torch.cat([tgt.new_tensor([tgt_dict.eos()]), tgt[:-1]])  # teacher forcing input
        tokens = {
            "source": [src_dict[i] for i in src.tolist()],
            "target": [tgt_dict[i] for i in tgt.tolist()],
            "decoder input": [tgt_dict[i] for i in prev.tolist()],
        }
        maps.append((sentence_attention(model, src, prev), tokens))
    os.makedirs(args.png_dir, exist_ok=True)
    files = []
    for kind in KINDS:
        layers = sorted({layer for m, _ in maps for k, layer in m if k == kind})
        if not layers:
            continue
        panels = [
            [_panel(kind, layer, m, tokens, label) for (m, tokens), label in zip(maps, labels)] for layer in layers
        ]
        title = f"{kind} attention, mean over heads\nsource: {args.sentence}\ntarget ({target_from}): {target_text}"
        path = os.path.join(args.png_dir, f"attention_{kind.replace(' ', '_')}.png")
        files.append({"module": kind, **plots.attention_heatmaps(path, kind, title, panels)})
    return {
        "sentence": args.sentence,
        "target": target_text,
        "target_from": target_from,
        "checkpoints": args.checkpoints,
        "names": names,
        "tokens": [t for _, t in maps],
        "files": files,
    }


def _panel(kind, layer, maps, tokens, label):
    if (kind, layer) not in maps:
        return None
    queries = tokens["source"] if kind == "encoder self" else tokens["target"]
    keys = {"encoder self": "source", "decoder self": "decoder input", "decoder cross": "source"}[kind]
    return f"{label}\nlayer {layer}", maps[(kind, layer)], queries, tokens[keys]


# ----------------------------------------------------------------------------- g over training


def g_history(args):
    from . import plots

    paths = sorted(glob.glob(os.path.join(args.directory, "checkpoint*.pt")))
    if not paths:
        fail(f"{args.directory}: no checkpoint*.pt in it")
    points = {}
    for path in paths:
        t = temperatures(path, load_checkpoint(path))
        if not t["g"]:
            fail(without_g(t))
        if t["num_updates"] is None:
            fail(f"{path}: no num_updates in its optimizer_history")
        points.setdefault(t["num_updates"], t)  # checkpoint_last/best repeat an epoch's update count
    updates = sorted(points)
    series = {}
    for n in updates:
        for r in points[n]["g"]:
            label = f"{r['module']} {r['layer']}" + ("" if r["head"] is None else f" head {r['head']}")
            series.setdefault(label, (r["module"], r["layer"], []))[2].append(r["g"])
    if any(len(values) != len(updates) for _, _, values in series.values()):
        fail(f"{args.directory}: its checkpoints do not all have the same modules")
    last = points[updates[-1]]
    name = args.labels[0] if args.labels else last["name"]
    title = f"learned temperature g over training: {name}\n{args.directory}, {last['arch']}, {len(updates)} checkpoints"
    os.makedirs(args.png_dir, exist_ok=True)
    png = plots.g_history(os.path.join(args.png_dir, "g_history.png"), title, updates, series, last["g0"], G_RANGE)
    return {
        "directory": args.directory,
        "name": name,
        "updates": updates,
        "g0": last["g0"],
        "g": {label: values for label, (_, _, values) in series.items()},
        "file": png,
    }


# ----------------------------------------------------------------------------- command line


def existing(kind):
    """An argparse type: the path, if it is an existing file or directory; so that a wrong path is
    said before any model is loaded."""
    check = os.path.isfile if kind == "file" else os.path.isdir

    def path(value):
        if not check(value):
            raise argparse.ArgumentTypeError(f"no such {kind}: {value}")
        return value

    return path


def parse_args(argv):
    summary, usage = __doc__.split("\n", 1)
    parser = argparse.ArgumentParser(
        prog="fairseq-qknorm-inspect",
        description=summary,
        epilog=usage,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--labels",
        nargs="+",
        metavar="NAME",
        help="one name per checkpoint for tables and figures (default: from each "
        "checkpoint's config, e.g. 'QKNorm: LayerNorm, l2 + learned g')",
    )
    common.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    model = argparse.ArgumentParser(add_help=False)  # stats and heatmaps: checkpoints side by side, run
    model.add_argument("checkpoint", type=existing("file"), metavar="CKPT", help="fairseq checkpoint")
    model.add_argument(
        "checkpoint2",
        type=existing("file"),
        metavar="CKPT2",
        nargs="?",
        help="a second checkpoint, shown beside the first (e.g. QKNorm beside the baseline)",
    )
    model.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is available")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = commands.add_parser("g", parents=[common], help="the learned g of every attention module against g0")
    g.add_argument("checkpoints", type=existing("file"), nargs="+", metavar="CKPT", help="fairseq checkpoint(s)")

    stats = commands.add_parser(
        "stats", parents=[common, model], help="attention entropy, max weight, saturation and logits on a data split"
    )
    stats.add_argument(
        "--data",
        type=existing("directory"),
        required=True,
        metavar="DATA_BIN",
        help="binarized data (fairseq-preprocess output)",
    )
    stats.add_argument("--subset", default="valid", help="split of --data (default: valid)")
    stats.add_argument("--max-tokens", type=int, default=4000, help="batch size in tokens (default: 4000)")

    heatmaps = commands.add_parser("heatmaps", parents=[common, model], help="attention heatmaps of one sentence")
    heatmaps.add_argument("--sentence", required=True, metavar="TEXT", help="the source sentence")
    heatmaps.add_argument(
        "--target", metavar="TEXT", help="its target, for teacher forcing (default: greedy translation by CKPT)"
    )
    heatmaps.add_argument(
        "--spm",
        type=existing("file"),
        required=True,
        metavar="SPM_MODEL",
        help="sentencepiece model that encodes --sentence and --target",
    )
    heatmaps.add_argument(
        "--data",
        type=existing("directory"),
        metavar="DATA_BIN",
        help="the dictionaries (default: the data path saved in the checkpoint)",
    )
    heatmaps.add_argument("--png-dir", required=True, metavar="DIR", help="where the PNG figures go")

    history = commands.add_parser("g-history", parents=[common], help="plot g over training")
    history.add_argument(
        "directory",
        type=existing("directory"),
        metavar="CKPT_DIR",
        help="a --save-dir: plots g of every CKPT_DIR/checkpoint*.pt",
    )
    history.add_argument("--png-dir", required=True, metavar="DIR", help="where the PNG figure goes")

    args = parser.parse_args(argv)
    if args.command in ("stats", "heatmaps"):
        args.checkpoints = [c for c in (args.checkpoint, args.checkpoint2) if c is not None]
    # The one rule argparse cannot say: one name per system.
    what, systems = ("CKPT_DIR", 1) if args.command == "g-history" else ("CKPT", len(args.checkpoints))
    if args.labels and len(args.labels) != systems:
        commands.choices[args.command].error(f"--labels: {len(args.labels)} given for {systems} {what}")
    return args


def main(argv=None):
    args = parse_args(argv)
    setup_logging()  # before fairseq is imported
    if "png_dir" in args:
        from .plots import require_matplotlib

        require_matplotlib()
    if args.command == "g":
        names = args.labels or [None] * len(args.checkpoints)
        result = [temperatures(path, load_checkpoint(path), name) for path, name in zip(args.checkpoints, names)]
        if len(result) == 1 and not result[0]["g"]:
            fail(without_g(result[0]))
    elif args.command == "g-history":
        result = g_history(args)
    else:
        import torch

        device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
        result = (attention_report if args.command == "stats" else heatmaps)(args, device)

    if args.json:
        print(json.dumps(result, indent=2))
    elif args.command == "g":
        for i, t in enumerate(result):
            print("\n" * (i > 0), end="")
            print_temperatures(t)
    elif args.command == "stats":
        print_attention(result)
    elif args.command == "heatmaps":
        for f in result["files"]:
            print(f"wrote {f['path']} ({f['width']}x{f['height']})")
    else:
        print(
            f"wrote {result['file']['path']} ({result['file']['width']}x{result['file']['height']}): "
            f"g of {len(result['g'])} {'heads' if any('head' in k for k in result['g']) else 'modules'} "
            f"at updates {', '.join(map(str, result['updates']))}"
        )


if __name__ == "__main__":
    main()
