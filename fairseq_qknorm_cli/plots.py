"""PNG figures for fairseq-qknorm-inspect: attention heatmaps of one sentence (checkpoints side by
side, one row per layer) and the learned temperature g over training. matplotlib is an optional
extra (`pip install 'fairseq-qknorm[plot]'`); it is imported only here, only when a figure is drawn.
Figures are drawn without pyplot (no global state, no display needed) and written to a temporary
name, then renamed, so a PNG on disk is always complete."""

import os
import sys
import textwrap

DPI = 100
G_HISTORY_INCHES = (9.0, 5.5)
_KIND_COLORMAP = {"encoder self": "Blues", "decoder self": "Greens", "decoder cross": "Oranges"}
_AXES = {  # (x label, y label) per kind: keys along x, queries along y
    "encoder self": ("source token (key)", "source token (query)"),
    "decoder self": ("decoder input token (key)", "target token being predicted"),
    "decoder cross": ("source token", "target token being predicted"),
}


def panel_inches(n_tokens: int) -> float:
    """Side of one heatmap panel along an axis of n tokens: room for a readable label per token."""
    return round(min(14.0, max(3.5, 1.6 + 0.22 * n_tokens)), 1)


def _wrap(title, inches):
    """Wrap each line of a title to the figure's width (about 11 characters an inch at 12 pt)."""
    return "\n".join(textwrap.fill(line, max(20, int(11 * inches))) for line in title.split("\n"))


def require_matplotlib():
    """Called before any work, so that a missing extra is said at once, not after loading models."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("error: --png-dir needs matplotlib: pip install 'fairseq-qknorm[plot]'")


def _figure(width, height):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _save(fig, path):
    tmp = path + ".tmp"
    try:
        fig.savefig(tmp, format="png", dpi=DPI)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    os.replace(tmp, path)
    width, height = fig.get_size_inches()
    return {"path": path, "width": round(width * DPI), "height": round(height * DPI)}


def attention_heatmaps(path, kind, title, panels):
    """panels[row][col] = (panel title, (tgt, src) weights, query tokens, key tokens) or None:
    one row per layer, one column per checkpoint. Returns {"path", "width", "height"} in pixels."""
    nrows, ncols = len(panels), len(panels[0])
    present = [p for row in panels for p in row if p is not None]
    width = panel_inches(max(len(p[3]) for p in present))
    height = panel_inches(max(len(p[2]) for p in present))
    fig = _figure(ncols * width, nrows * height)
    fig.suptitle(_wrap(title, ncols * width))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    xlabel, ylabel = _AXES[kind]
    image = None
    for row in range(nrows):
        for col in range(ncols):
            ax, panel = axes[row][col], panels[row][col]
            if panel is None:  # this checkpoint has fewer layers
                ax.set_axis_off()
                continue
            panel_title, weights, queries, keys = panel
            image = ax.imshow(
                weights.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest"
            )
            # Wrapped to the panel's width: a longer line would run into the next panel's title.
            ax.set_title(_wrap(panel_title, width), fontsize="medium")
            ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize="small")
            ax.set_yticks(range(len(queries)), queries, fontsize="small")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
    # One scale for every panel, 0 to 1, so that saturation looks the same in every model.
    fig.colorbar(image, ax=axes.ravel().tolist(), label="attention weight (mean over heads)", shrink=0.6)
    return _save(fig, path)


def g_history(path, title, updates, series, g0, reference_range):
    """series: {label: (kind, layer, values per checkpoint)}; g0: the initial g (or None);
    reference_range: (low, high) of g read off trained QKNorm heads by Bricken & Pehlevan."""
    fig = _figure(*G_HISTORY_INCHES)
    ax = fig.subplots()
    from matplotlib import colormaps

    layers = 1 + max(layer for _, layer, _ in series.values())
    labelled = set()
    for kind, layer, values in series.values():
        color = colormaps[_KIND_COLORMAP[kind]](0.45 + 0.5 * layer / max(layers - 1, 1))
        legend = f"{kind}, layer {layer}"
        ax.plot(
            updates, values, marker="o", markersize=3, color=color, label=None if legend in labelled else legend
        )  # heads of one module share an entry
        labelled.add(legend)
    if g0 is not None:
        ax.axhline(g0, color="grey", linestyle="--", label=f"g0 = {g0:.2f}")
    # The 10-25 band is drawn for reference without widening the axis to it.
    bottom, top = ax.get_ylim()
    low, high = reference_range
    ax.axhspan(
        low,
        high,
        color="tab:purple",
        alpha=0.08,
        label=f"{low:g}-{high:g}: g of trained QKNorm heads (Bricken & Pehlevan)",
    )
    ax.set_ylim(bottom, top)
    fig.suptitle(_wrap(title, G_HISTORY_INCHES[0]))
    ax.set_xlabel("training updates")
    ax.set_ylabel("learned temperature g")
    ax.grid(alpha=0.3)
    # Beside the axes, not over them: every point of every line stays visible (the constrained
    # layout narrows the axes to make room).
    ax.legend(
        loc="upper left",
        bbox_to_anchor=(1.02, 1),
        borderaxespad=0,
        fontsize="small",
        ncol=2 if len(labelled) > 12 else 1,
    )
    return _save(fig, path)


def dev_curves(path, title, runs):
    """runs: [(label, dashed, [(updates, dev loss, dev BLEU)])]: dev loss and dev BLEU side by side.
    Labels that agree up to their first comma ("baseline, run 2") share a colour."""
    fig = _figure(10, 4)
    loss_ax, bleu_ax = fig.subplots(1, 2)
    colors = {}
    for label, dashed, rows in runs:
        updates = [r[0] for r in rows]
        color = colors.setdefault(label.split(",")[0], f"C{len(colors)}")
        style = dict(linestyle="--" if dashed else "-", marker="o", markersize=3, color=color)
        loss_ax.plot(updates, [r[1] for r in rows], label=label, **style)
        bleu_ax.plot(updates, [r[2] for r in rows], **style)
    loss_ax.set(xlabel="training updates", ylabel="dev loss (bits per token, label-smoothed)")
    bleu_ax.set(xlabel="training updates", ylabel="dev BLEU (--eval-bleu, beam 4)")
    for ax in (loss_ax, bleu_ax):
        ax.grid(alpha=0.3)
    loss_ax.legend(fontsize="small")
    fig.suptitle(_wrap(title, 10))
    return _save(fig, path)


def training_and_scores(path, title, curves, scores):
    """curves: {cell: [(updates, training loss)]}; scores: {cell: [{metric: value} per run]}: the
    cells' training loss beside every run's scores, one column of dots per cell and metric."""
    fig = _figure(11, 4.2)
    loss_ax, score_ax = fig.subplots(1, 2, width_ratios=(3, 2))
    for i, (cell, points) in enumerate(curves.items()):
        loss_ax.plot([u for u, _ in points], [v for _, v in points], color=f"C{i}", label=cell)
    loss_ax.set(xlabel="training updates", ylabel="training loss (bits per token, label-smoothed)")
    loss_ax.legend(fontsize="small")
    metrics = sorted({m for runs in scores.values() for values in runs for m in values})
    for i, runs in enumerate(scores.values()):
        for j, metric in enumerate(metrics):
            x = i + (j - (len(metrics) - 1) / 2) * 0.25
            values = [v[metric] for v in runs]
            score_ax.scatter([x] * len(values), values, color=f"C{i}", marker="os^D"[j % 4], s=25)
    score_ax.set_xticks(range(len(scores)), [c.replace(" + ", "\n+ ") for c in scores], fontsize="small")
    score_ax.set(ylabel="BLEU, one dot per seed")
    score_ax.legend(
        [score_ax.scatter([], [], color="grey", marker="os^D"[j % 4]) for j in range(len(metrics))],
        metrics,
        fontsize="small",
    )
    for ax in (loss_ax, score_ax):
        ax.grid(alpha=0.3)
    fig.suptitle(_wrap(title, 11))
    return _save(fig, path)
