"""fairseq_pardec: parallel decoding for fairseq Transformers, as a --user-dir plugin.

Install torch first, then fairseq without build isolation (see README, "Install"): otherwise pip
builds fairseq against a freshly downloaded (CUDA, multi-GB) torch.
"""

from setuptools import find_packages, setup

setup(
    name="fairseq_pardec",
    version="0.1.0",
    description="Blockwise, aggressive (IAD/GAD) and interleaved bidirectional decoding for fairseq",
    packages=find_packages(include=["fairseq_pardec", "fairseq_pardec.*"]),
    # the native product kernel's source, compiled on first use (decoding/step/native.py)
    package_data={"fairseq_pardec.decoding.step": ["native_linear.c", "native_layers.c"]},
    python_requires=">=3.11",
    install_requires=[
        "torch>=2.6,<3",
        # Stock fairseq 0.12.2 does not import on Python >= 3.11; fairseq-fixed is fairseq main
        # with the 3.11 fixes (module name: fairseq).
        "fairseq-fixed==0.12.3.1",
        "numpy>=1.26",
        "sacrebleu>=2.3,<3",
        "subword-nmt>=0.3.8,<0.4",
        "matplotlib>=3.7",
        "tqdm>=4.60",
    ],
    extras_require={
        "test": ["pytest>=7"],
        # CTranslate2 rows in the benchmark (python -m fairseq_pardec.benchmark --generators ct2)
        "ct2": ["ctranslate2>=4.5,<5"],
    },
    entry_points={"console_scripts": ["pardec-benchmark=fairseq_pardec.benchmark:cli_main"]},
)
