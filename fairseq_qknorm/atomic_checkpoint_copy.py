"""Make fairseq's checkpoint copies atomic, so that no truncated checkpoint ever has a final name.

fairseq's save_checkpoint writes the first file of a save atomically (NAME.pt.tmp, then a rename) but
copies it to its other names in place (PathManager.copy, i.e. shutil.copyfile), e.g.
checkpoint_best.pt to checkpoint_last.pt. Killed during that copy, training leaves a truncated
checkpoint_last.pt, and every rerun then fails to resume from it. Here the copy goes to DST.tmp and
is renamed when complete, as fairseq writes the first file.
"""
import os

from fairseq.file_io import PathManager

_fairseq_copy = PathManager.copy


def _atomic_copy(src_path, dst_path, overwrite=False):
    if not PathManager.supports_rename(dst_path):  # a remote path (iopath): as fairseq does
        return _fairseq_copy(src_path, dst_path, overwrite=overwrite)
    copied = _fairseq_copy(src_path, dst_path + ".tmp", overwrite=True)
    os.replace(dst_path + ".tmp", dst_path)
    return copied


def make_checkpoint_copies_atomic() -> None:
    PathManager.copy = staticmethod(_atomic_copy)
