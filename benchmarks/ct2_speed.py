"""CPU speed of a transformer_lm_qknorm model served by CTranslate2 against fairseq itself:
`python -m benchmarks.ct2_speed --checkpoint CKPT --data DATA_BIN`.

Greedy continuation of the first --prompts sentences of DATA_BIN's --subset (default valid) (their first 8
tokens as the prompt, --new-tokens generated, no early stop at </s>): fairseq's SequenceGenerator
(beam 1, incremental decoding, as fairseq-interactive runs it) against CTranslate2's Generator in
float32 and int8, each with --threads threads, one prompt at a time and all prompts as one batch.
The model is exported with fairseq-qknorm-export-ct2. Reported: tokens per second of wall time and
of this process's CPU time (the steadier of the two on a shared machine), best of --repeats.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch


def best_of(repeats, fn):
    """(best wall s, best CPU s) of `repeats` calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return min(t[0] for t in times), min(t[1] for t in times)


def fairseq_runner(hub, prompts, new_tokens, batched):
    from fairseq.sequence_generator import SequenceGenerator

    generator = SequenceGenerator(
        hub.models,
        hub.task.target_dictionary,
        beam_size=1,
        max_len_a=0,
        max_len_b=new_tokens + len(prompts[0]),
        min_len=new_tokens + len(prompts[0]),
    )
    eos = hub.task.source_dictionary.eos()
    batches = [prompts] if batched else [[p] for p in prompts]

    def run():
        with torch.no_grad():
            for batch in batches:
                src = torch.stack([torch.cat([torch.tensor([eos]), p]) for p in batch])
                sample = {"net_input": {"src_tokens": src, "src_lengths": torch.full((len(batch),), src.size(1))}}
                generator.generate(hub.models, sample, prefix_tokens=src[:, 1:])

    return run


def ct2_runner(model_dir, compute_type, threads, words, new_tokens, batched):
    import ctranslate2

    generator = ctranslate2.Generator(model_dir, device="cpu", compute_type=compute_type, intra_threads=threads)
    batches = [words] if batched else [[w] for w in words]

    def run():
        for batch in batches:
            generator.generate_batch(
                batch, max_length=new_tokens, min_length=new_tokens, sampling_topk=1, include_prompt_in_result=False
            )

    return run


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.ct2_speed", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="a transformer_lm_qknorm checkpoint")
    p.add_argument("--data", required=True, help="its binarized data (dict.txt and the --subset split)")
    p.add_argument("--subset", default="valid", help="the split the prompts come from")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the measurements here")
    args = p.parse_args(argv)
    for path, what in ((args.checkpoint, "--checkpoint"), (os.path.join(args.data, "dict.txt"), "--data")):
        if not os.path.isfile(path):
            sys.exit(f"error: {what}: no such file {path}")
    torch.set_num_threads(args.threads)
    from fairseq.data import data_utils
    from fairseq.models.transformer_lm import TransformerLanguageModel

    import fairseq_qknorm  # noqa: F401

    folder, name = os.path.split(os.path.abspath(args.checkpoint))
    hub = TransformerLanguageModel.from_pretrained(folder, name, data_name_or_path=args.data).eval()
    d = hub.task.source_dictionary
    test = data_utils.load_indexed_dataset(os.path.join(args.data, args.subset), d)
    if test is None:
        sys.exit(f"error: --subset {args.subset}: no such split in {args.data}")
    prompts = [test[i][:8] for i in range(len(test)) if len(test[i]) >= 9][: args.prompts]
    words = [[d[d.eos()]] + [d[t] for t in p.tolist()] for p in prompts]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for quantization in ("float32", "int8"):
            out = os.path.join(tmp, quantization)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "fairseq_qknorm_cli.export_ct2",
                    "--model_path",
                    args.checkpoint,
                    "--data_dir",
                    args.data,
                    "--output_dir",
                    out,
                    "--quantization",
                    quantization,
                ],
                check=True,
                capture_output=True,
            )
        for batched in (False, True):
            runners = {"fairseq fp32": fairseq_runner(hub, prompts, args.new_tokens, batched)}
            for quantization in ("float32", "int8"):
                runners[f"CTranslate2 {quantization}"] = ct2_runner(
                    os.path.join(tmp, quantization), quantization, args.threads, words, args.new_tokens, batched
                )
            for name, run in runners.items():
                wall, cpu = best_of(args.repeats, run)
                tokens = len(prompts) * args.new_tokens
                results.append(
                    {
                        "engine": name,
                        "batch": len(prompts) if batched else 1,
                        "tokens_per_s_wall": tokens / wall,
                        "tokens_per_s_cpu": tokens / cpu,
                    }
                )
    params = sum(p.numel() for p in hub.models[0].parameters())
    print(
        f"{hub.cfg.model.arch}, {params / 1e6:.1f}M parameters, {len(prompts)} prompts x {args.new_tokens} "
        f"new tokens, greedy, {args.threads} thread(s), best of {args.repeats}"
    )
    print("| engine | batch | tokens/s (wall) | tokens/s (CPU time) | vs fairseq (CPU time) |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        base = next(b for b in results if b["batch"] == r["batch"] and b["engine"] == "fairseq fp32")
        print(
            f"| {r['engine']} | {r['batch']} | {r['tokens_per_s_wall']:.0f} | {r['tokens_per_s_cpu']:.0f} | "
            f"{r['tokens_per_s_cpu'] / base['tokens_per_s_cpu']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"arch": hub.cfg.model.arch, "parameters": params, "args": vars(args), "results": results}, f, indent=1
            )


if __name__ == "__main__":
    main()
