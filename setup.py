"""fairseq-qknorm: Query-Key Normalization (Henry et al., 2020) as a fairseq --user-dir plugin.

fairseq is deliberately not in install_requires: users who built fairseq from source, or use a
fork, already have it under their own distribution name. The tested build, ve-fairseq (upstream
fairseq main plus the Python 3.11 patch), declares torchaudio, which translation never uses and
whose wheels pull or need another torch: it is installed with `pip install --no-deps` (README), and
what fairseq really needs at run time is listed here instead.
"""

from setuptools import find_packages, setup

setup(
    name="fairseq-qknorm",
    version="0.1.3",
    description="Query-Key Normalization for fairseq transformers (Henry et al., EMNLP Findings 2020)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["fairseq_qknorm", "fairseq_qknorm_cli"]),
    package_data={"fairseq_qknorm": ["config/*.yaml"]},
    python_requires=">=3.9",
    install_requires=[
        "torch>=2.4",  # torch.serialization.add_safe_globals: the allow-list of safe checkpoint loading
        "numpy",
        "sentencepiece",
        "sacrebleu>=2.0",
        # fairseq's moses tokenizer and detokenizer (--eval-bleu-detok moses, as its IWSLT'14 example
        # trains); pure Python: it needs click, joblib, regex and tqdm, no torch
        "sacremoses",
        # fairseq's own needs, as ve-fairseq declares them, less torchaudio
        "bitarray",
        "cffi",
        "cython",
        "hydra-core>=1.3.2",
        "omegaconf",
        "packaging",
        "regex",
        "scikit-learn",
        "tqdm",
    ],
    extras_require={
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
