"""Console scripts of fairseq-qknorm. Only those that need fairseq import it."""
