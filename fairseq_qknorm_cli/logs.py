"""fairseq's log format for the project's own tools, so their lines read like fairseq's."""

import logging
import sys


def setup_logging(stream=sys.stderr):
    """Call before fairseq is imported: importing fairseq otherwise leaves the root logger at DEBUG
    (hydra's setup), and matplotlib and others then flood the output."""
    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        level=logging.INFO,
        stream=stream,
    )
