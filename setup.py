"""fairseq-qknorm: Query-Key Normalization (Henry et al., 2020) as a fairseq --user-dir plugin.

fairseq is deliberately not in install_requires: users who built fairseq from source, or use a
fork, already have it under their own distribution name. `pip install fairseq-qknorm[fairseq]`
pulls the tested build (ve-fairseq: upstream fairseq main plus the Python 3.11 patch).
"""
from setuptools import find_packages, setup

setup(
    name="fairseq-qknorm",
    version="0.1.0",
    description="Query-Key Normalization for fairseq transformers (Henry et al., EMNLP Findings 2020)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["fairseq_qknorm", "fairseq_qknorm_cli"]),
    package_data={"fairseq_qknorm": ["config/*.yaml"]},
    python_requires=">=3.9",
    install_requires=["torch>=2.0", "numpy", "sentencepiece", "sacrebleu>=2.0"],
    extras_require={
        "fairseq": ["ve-fairseq==0.12.3"],
        "plot": ["matplotlib"],
        "test": ["pytest"],
    },
    entry_points={
        "console_scripts": [
            "fairseq-qknorm-user-dir = fairseq_qknorm_cli.user_dir:main",
            "fairseq-qknorm-spm-train = fairseq_qknorm_cli.spm:train_main",
            "fairseq-qknorm-spm-encode = fairseq_qknorm_cli.spm:encode_main",
            "fairseq-qknorm-spm-decode = fairseq_qknorm_cli.spm:decode_main",
            "fairseq-qknorm-toy-corpus = fairseq_qknorm_cli.toy_corpus:main",
            "fairseq-qknorm-score = fairseq_qknorm_cli.score:main",
            "fairseq-qknorm-inspect = fairseq_qknorm_cli.inspect_checkpoints:main",
            "fairseq-qknorm-export-ct2 = fairseq_qknorm_cli.export_ct2:main",
        ]
    },
)
