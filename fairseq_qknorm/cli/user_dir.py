"""Print the directory to pass to fairseq's --user-dir."""
import os


def main():
    # Not `import fairseq_qknorm`: that imports fairseq, and this must answer instantly.
    print(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


if __name__ == "__main__":
    main()
