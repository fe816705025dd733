"""megatron-glm5: train the GLM-5 family on megatron-core."""
from setuptools import find_packages, setup

CORE = [
    "torch>=2.6",
    "megatron-core==0.19.2",
    "transformers>=5.2",
    "safetensors",
    "tokenizers",
    "sentencepiece",
    "tensorboard",
    "tqdm",
    # megatron-core pulls numpy; numpy 2.5 is a 3.12-only source build on Python 3.11.
    "numpy<2.5",
    "pyyaml",
    "jinja2",
    "psutil",
]

setup(
    name="megatron-glm5",
    version="0.1.0",
    description="Pretraining and fine-tuning of the GLM-5 family (MLA + DSA + MoE) on megatron-core",
    packages=find_packages(include=["megatron_glm5", "megatron_glm5.*"]),
    python_requires=">=3.10",
    install_requires=CORE,
    extras_require={
        # triton: tests/test_ops_triton.py runs the Triton kernels on CPU through its interpreter
        # peft: LoRA export check; pytest-xdist: two workers, one test file each at a time (pytest.ini)
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "triton==3.6.0", "accelerate", "peft>=0.21"],
        "gpu": ["triton>=3.6"],
        "tilelang": ["tilelang>=0.1.15"],
        "cudnn": ["nvidia-cudnn-frontend[cutedsl]>=1.32"],  # cudnn.DSA, read from 1.32.0
        "te": ["transformer-engine[pytorch]"],
    },
    entry_points={},
)
