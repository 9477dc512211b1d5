"""Speed and memory of transformer_qknorm against fairseq's transformer: `python -m benchmarks.run`."""
