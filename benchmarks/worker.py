"""One benchmark arm in its own process (forked from the runner, so fairseq is imported once): it
builds and warms up its workload, then measures whenever the runner asks, so that the runner can
interleave the arms; at the end it reports its peak memory."""

import traceback

import torch

from .timing import peak_rss_mb, return_freed_memory


def _workload(job):
    if job["benchmark"] == "attention":
        from .attention_bench import AttentionBench

        return AttentionBench(job)
    from .models_bench import GenerateBench, TrainBench

    # memory: the training workload, for its peak memory alone
    return {"train": TrainBench, "memory": TrainBench, "generate": GenerateBench}[job["benchmark"]](job)


def serve(conn, job):
    try:
        torch.set_num_threads(job["threads"])
        freed_returned = job["benchmark"] == "memory" and return_freed_memory()
        start_rss = peak_rss_mb()
        bench = _workload(job)
        info = dict(bench.info, freed_memory_returned=freed_returned)
        if job["device"].startswith("cuda"):
            info["device_name"] = torch.cuda.get_device_name()
        conn.send({"info": info})
        while True:
            try:
                command, unit = conn.recv()
            except EOFError:  # the runner is gone: nothing to report to
                return
            if command != "measure":
                break
            conn.send(bench.measure(unit))
        stats = {"peak_rss_mb": peak_rss_mb(), "start_rss_mb": start_rss}
        if job["device"].startswith("cuda"):
            stats["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
        conn.send(stats)
    except Exception:  # the runner shows it and stops
        conn.send({"error": traceback.format_exc()})
    finally:
        conn.close()
