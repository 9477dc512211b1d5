"""fairseq-qknorm-inspect: look inside trained checkpoints.

  fairseq-qknorm-inspect CKPT                          every learned temperature g, against g0 and 10-25
  fairseq-qknorm-inspect CKPT [CKPT2] --data BIN       attention entropy, max weight, saturation, logits
  fairseq-qknorm-inspect CKPT [CKPT2] --sentence TEXT --spm SPM --png-dir DIR    attention heatmaps
  fairseq-qknorm-inspect --g-history CKPT_DIR --png-dir DIR                      g over training

The g table reads only the checkpoint (no data, no model built). Statistics and heatmaps load the
model(s) through fairseq and run them in eval mode with teacher forcing.
"""
import argparse
import glob
import json
import logging
import os
import statistics
import sys
import warnings

G_SUFFIX = ".qk_scale.g"
G_RANGE = (10.0, 25.0)  # g read off trained QKNorm heads by Bricken & Pehlevan (2021)


def fail(message):
    sys.exit(f"error: {message}")


# ----------------------------------------------------------------------------- checkpoints


def load_checkpoint(path):
    """The checkpoint as a dict, loaded with weights_only=True (the plugin allow-lists fairseq's
    few non-tensor classes on import)."""
    if not os.path.isfile(path):
        fail(f"no such checkpoint: {path}")
    import fairseq_qknorm  # noqa: F401
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
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


def describe_attention(model_cfg):
    qk_norm, qk_scale = getattr(model_cfg, "qk_norm", None), getattr(model_cfg, "qk_scale", None)
    if qk_scale in (None, "none"):
        scaled = "scaled dot product"
        return scaled if qk_norm in (None, "none") else f"{qk_norm}-normalized q,k, {scaled}"
    return f"QKNorm ({qk_norm} q,k, {qk_scale} g)"


def temperatures(path, state):
    """Every g of one checkpoint, with its g0 and L, as a JSON-ready dict."""
    from fairseq_qknorm.length_prior import length_from_g0

    from .attention_stats import attention_module, sort_key

    cfg = model_config(state)
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
        fail(f"{path} has no QKNorm temperature g (no '*{G_SUFFIX}' parameter; "
             f"arch {getattr(cfg, 'arch', '?')}, attention: {describe_attention(cfg)}); "
             "--data gives attention statistics for any checkpoint")
    rows.sort(key=lambda r: (sort_key((r["module"], r["layer"])), r["head"] or 0))
    g0 = getattr(cfg, "qk_scale_init", None)
    g0 = float(g0) if isinstance(g0, (int, float)) else None  # 'auto' only in pre-build configs
    gs = [r["g"] for r in rows]
    low, high = G_RANGE
    return {
        "checkpoint": path,
        "arch": getattr(cfg, "arch", None),
        "num_updates": num_updates(state),
        "qk_norm": getattr(cfg, "qk_norm", None),
        "qk_scale": getattr(cfg, "qk_scale", None),
        "per_head": rows[0]["head"] is not None,
        "g0": g0,
        "L": length_from_g0(g0) if g0 is not None and getattr(cfg, "qk_scale", None) == "learned" else None,
        "g": rows,
        "summary": {"count": len(gs), "min": min(gs), "median": statistics.median(gs), "max": max(gs),
                    "below": sum(g < low for g in gs), "within": sum(low <= g <= high for g in gs),
                    "above": sum(g > high for g in gs)},
    }


def print_temperatures(t):
    g0 = t["g0"]
    print(f"{t['checkpoint']}: {t['arch']}, {t['num_updates']} updates, qk-norm {t['qk_norm']}, "
          f"qk-scale {t['qk_scale']}, one g per {'head' if t['per_head'] else 'attention module'}")
    if t["qk_scale"] == "fixed":  # a constant, not derived from a length: nothing learned to show
        print(f"g = {g0:.4f} in every module, fixed (--qk-scale fixed --qk-scale-init {g0:g}): not learned")
        return
    if g0 is not None:
        print(f"g0 = {g0:.4f} = log2(L^2 - L), L = {t['L']:.0f}")
    rows = [["module", "layer", "head", "g", "g - g0"]]
    for r in t["g"]:
        rows.append([r["module"], str(r["layer"]), "-" if r["head"] is None else str(r["head"]), f"{r['g']:.4f}",
                     "-" if g0 is None else f"{r['g'] - g0:+.4f}"])
    print_table(rows, left=2)
    print(summary_line(t))


def summary_line(t):
    s = t["summary"]
    low, high = G_RANGE
    start = "" if t["g0"] is None else f", g0 {t['g0']:.2f}"
    return (f"summary: {s['count']} g from {s['min']:.2f} to {s['max']:.2f} (median {s['median']:.2f}{start}); "
            f"{s['within']} of {s['count']} within {low:g}-{high:g}, the range Bricken & Pehlevan read off "
            f"trained QKNorm heads ({s['below']} below, {s['above']} above)")


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
    if not os.path.isfile(path):
        fail(f"no such checkpoint: {path}")
    if data is not None and not os.path.isdir(data):
        fail(f"--data: no such directory: {data}")
    import fairseq_qknorm  # noqa: F401  registers the model and allow-lists checkpoint classes
    from fairseq import checkpoint_utils

    try:
        models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
            [path], arg_overrides={"data": data} if data is not None else None)
    except FileNotFoundError as e:
        where = "--data" if data is not None else f"{path} (its training data; pass --data)"
        fail(f"{where}: {e}")
    return models[0].to(device).eval(), cfg.model, task


def checkpoint_label(index, path, model_cfg):
    return f"[{index}] {path} ({getattr(model_cfg, 'arch', '?')}, {describe_attention(model_cfg)})"


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
        dataset=dataset, max_tokens=max_tokens,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        required_batch_size_multiple=1,  # the default 8 silently drops the last batch
    ).next_epoch_itr(shuffle=False)
    device = next(model.parameters()).device
    stats, sentences = {}, 0
    for batch in batches:
        batch = utils.move_to_cuda(batch, device=device) if device.type == "cuda" else batch
        net = batch["net_input"]
        forward_with_stats(model, stats, net["src_tokens"], net["src_lengths"], net["prev_output_tokens"],
                           task.target_dictionary.pad())
        sentences += batch["nsentences"]
    if sentences != len(dataset):
        fail(f"--subset {subset}: saw {sentences} of {len(dataset)} sentence pairs (longer than the model allows?)")
    return stats, sentences


def attention_report(args, device):
    from .attention_stats import SATURATION, sort_key

    runs = []
    for index, path in enumerate(args.checkpoints, 1):
        model, cfg, task = load_model(path, args.data, device)
        stats, sentences = subset_statistics(model, task, args.subset, args.max_tokens)
        runs.append({
            "checkpoint": path, "label": checkpoint_label(index, path, cfg), "sentences": sentences,
            "modules": [{"module": w[0], "layer": w[1], **stats[w].summary()} for w in sorted(stats, key=sort_key)],
        })
    return {"data": args.data, "subset": args.subset, "saturation_threshold": SATURATION, "checkpoints": runs}


def print_attention(report):
    runs = report["checkpoints"]
    print(f"attention on '{report['subset']}' of {report['data']}: {runs[0]['sentences']} sentence pairs, "
          "eval mode, teacher forcing")
    print("per module, over heads and query rows (real tokens with at least two keys to choose from): mean "
          "entropy (nats), mean maximum weight (max w), share of rows with maximum weight > "
          f"{report['saturation_threshold']:g} (saturated), range of the pre-softmax logits")
    for run in runs:
        print(run["label"])
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
            row += ["-"] * len(columns) if m is None else [
                f"{m['entropy']:.3f}", f"{m['max_weight']:.3f}", f"{100 * m['saturated']:.1f}%",
                f"{m['logit_min']:.2f} .. {m['logit_max']:.2f}"]
        rows.append(row)
    print_table(rows, left=2)


# ----------------------------------------------------------------------------- heatmaps


def encode(sp, dictionary, text):
    """Text -> token ids with </s>, through the sentencepiece model and the model's dictionary."""
    return dictionary.encode_line(" ".join(sp.encode(text, out_type=str)), add_if_not_exist=False,
                                  append_eos=True).long()


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

    if not os.path.isfile(args.spm):
        fail(f"--spm: no such sentencepiece model: {args.spm}")
    sp = spm.SentencePieceProcessor(model_file=args.spm)
    loaded = [(path, *load_model(path, args.data, device)) for path in args.checkpoints]
    target_text, target_from = args.target, "given"
    if target_text is None:  # the first checkpoint's greedy translation, the same target for all
        _, model, _, task = loaded[0]
        src = encode(sp, task.source_dictionary, args.sentence).to(device)
        out = greedy_translation(model, src, task.target_dictionary)
        target_text = sp.decode([task.target_dictionary[i] for i in out[:-1].tolist()])
        target_from = "greedy translation by [1]"
    maps, labels = [], []
    for index, (path, model, cfg, task) in enumerate(loaded, 1):
        src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
        src, tgt = encode(sp, src_dict, args.sentence).to(device), encode(sp, tgt_dict, target_text).to(device)
        prev = torch.cat([tgt.new_tensor([tgt_dict.eos()]), tgt[:-1]])  # teacher forcing input
        tokens = {"source": [src_dict[i] for i in src.tolist()], "target": [tgt_dict[i] for i in tgt.tolist()],
                  "decoder input": [tgt_dict[i] for i in prev.tolist()]}
        maps.append((sentence_attention(model, src, prev), tokens))
        labels.append(f"[{index}] {os.path.basename(os.path.dirname(os.path.abspath(path)))}/"
                      f"{os.path.basename(path)}: {describe_attention(cfg)}")
    os.makedirs(args.png_dir, exist_ok=True)
    files = []
    for kind in KINDS:
        layers = sorted({layer for m, _ in maps for k, layer in m if k == kind})
        if not layers:
            continue
        panels = [[_panel(kind, layer, m, tokens, label) for (m, tokens), label in zip(maps, labels)]
                  for layer in layers]
        title = (f"{kind} attention, mean over heads\nsource: {args.sentence}\n"
                 f"target ({target_from}): {target_text}")
        path = os.path.join(args.png_dir, f"attention_{kind.replace(' ', '_')}.png")
        files.append({"module": kind, **plots.attention_heatmaps(path, kind, title, panels)})
    return {"sentence": args.sentence, "target": target_text, "target_from": target_from,
            "checkpoints": labels, "tokens": [t for _, t in maps], "files": files}


def _panel(kind, layer, maps, tokens, label):
    if (kind, layer) not in maps:
        return None
    queries = tokens["source"] if kind == "encoder self" else tokens["target"]
    keys = {"encoder self": "source", "decoder self": "decoder input", "decoder cross": "source"}[kind]
    return f"{label}\nlayer {layer}", maps[(kind, layer)], queries, tokens[keys]


# ----------------------------------------------------------------------------- g over training


def g_history(args):
    from . import plots

    paths = sorted(glob.glob(os.path.join(args.g_history, "checkpoint*.pt")))
    if not paths:
        fail(f"--g-history: no checkpoint*.pt in {args.g_history}")
    points = {}
    for path in paths:
        t = temperatures(path, load_checkpoint(path))
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
        fail(f"--g-history: the checkpoints in {args.g_history} do not all have the same modules")
    last = points[updates[-1]]
    title = (f"learned temperature g over training: {os.path.abspath(args.g_history)}\n"
             f"{last['arch']}, qk-norm {last['qk_norm']}, {len(updates)} checkpoints")
    os.makedirs(args.png_dir, exist_ok=True)
    png = plots.g_history(os.path.join(args.png_dir, "g_history.png"), title, updates, series, last["g0"], G_RANGE)
    return {"directory": args.g_history, "updates": updates, "g0": last["g0"],
            "g": {label: values for label, (_, _, values) in series.items()}, "file": png}


# ----------------------------------------------------------------------------- command line


def parse_args(argv):
    summary, usage = __doc__.split("\n", 1)
    parser = argparse.ArgumentParser(prog="fairseq-qknorm-inspect", description=summary, epilog=usage,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="*", metavar="CHECKPOINT",
                        help="fairseq checkpoint(s); with --data or --sentence, two are shown side by side "
                             "(e.g. baseline and QKNorm)")
    parser.add_argument("--data", metavar="DATA_BIN",
                        help="binarized data: attention statistics on its --subset (also the dictionaries "
                             "for --sentence; default there: the data path saved in the checkpoint)")
    parser.add_argument("--subset", default="valid", help="split of --data for the statistics (default: valid)")
    parser.add_argument("--max-tokens", type=int, default=4000, help="batch size in tokens (default: 4000)")
    parser.add_argument("--sentence", metavar="TEXT", help="draw attention heatmaps for this source sentence")
    parser.add_argument("--target", metavar="TEXT",
                        help="its target, for teacher forcing (default: greedy translation by the first checkpoint)")
    parser.add_argument("--spm", metavar="SPM_MODEL", help="sentencepiece model that encodes --sentence/--target")
    parser.add_argument("--g-history", metavar="CKPT_DIR", help="plot g over training from CKPT_DIR/checkpoint*.pt")
    parser.add_argument("--png-dir", metavar="DIR", help="where the PNG figures go")
    parser.add_argument("--cpu", action="store_true", help="run the model on the CPU even if a GPU is available")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    args = parser.parse_args(argv)
    if not args.checkpoints and not args.g_history:
        parser.error("give a CHECKPOINT, or --g-history CKPT_DIR")
    if args.sentence is not None and not args.spm:
        parser.error("--sentence needs --spm SPM_MODEL")
    if (args.sentence is not None or args.g_history) and not args.png_dir:
        parser.error("--sentence and --g-history need --png-dir DIR")
    if args.sentence is None and args.target is not None:
        parser.error("--target needs --sentence")
    if not args.checkpoints and (args.data or args.sentence is not None):
        parser.error("--data and --sentence need a CHECKPOINT")
    return args


def main(argv=None):
    args = parse_args(argv)
    # Before fairseq is imported: its log lines as fairseq's commands print them, and at INFO (an
    # import of fairseq otherwise leaves the root logger at DEBUG, and matplotlib then floods).
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", level=logging.INFO, stream=sys.stderr)
    if args.png_dir:
        from .plots import require_matplotlib

        require_matplotlib()
    result = {}
    if args.checkpoints and args.data is None and args.sentence is None:
        result["temperatures"] = [temperatures(path, load_checkpoint(path)) for path in args.checkpoints]
    if args.data is not None or args.sentence is not None:
        import torch

        device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
        if args.data is not None:
            result["attention"] = attention_report(args, device)
        if args.sentence is not None:
            result["heatmaps"] = heatmaps(args, device)
    if args.g_history:
        result["g_history"] = g_history(args)

    if args.json:
        print(json.dumps(result, indent=2))
        return
    for i, t in enumerate(result.get("temperatures", [])):
        print("\n" * (i > 0), end="")
        print_temperatures(t)
    if "attention" in result:
        print_attention(result["attention"])
    for f in result.get("heatmaps", {}).get("files", []):
        print(f"wrote {f['path']} ({f['width']}x{f['height']})")
    if "g_history" in result:
        h = result["g_history"]
        print(f"wrote {h['file']['path']} ({h['file']['width']}x{h['file']['height']}): g of {len(h['g'])} "
              f"{'heads' if any('head' in k for k in h['g']) else 'modules'} at updates "
              f"{', '.join(map(str, h['updates']))}")


if __name__ == "__main__":
    main()
