"""Print the directory to pass to fairseq's --user-dir."""

import importlib.util
import os


def main():
    # find_spec, not import: importing the plugin imports fairseq, and this must answer instantly.
    spec = importlib.util.find_spec("fairseq_qknorm")
    print(os.path.dirname(spec.origin))


if __name__ == "__main__":
    main()
