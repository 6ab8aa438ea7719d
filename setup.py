"""fairseq_pardec: parallel decoding for fairseq Transformers, as a --user-dir plugin.

Install torch first, then fairseq without build isolation (see README, "Install"): otherwise pip
builds fairseq against a freshly downloaded (CUDA, multi-GB) torch.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

NATIVE_DIR = Path(__file__).resolve().parent / "fairseq_pardec" / "native"
NATIVE = "fairseq_pardec.native.libpardec_native"


def _native_module(name):
    """native/<name>.py, loaded by path (the package imports torch)."""
    spec = importlib.util.spec_from_file_location("_pardec_" + name, NATIVE_DIR / (name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _native_build():
    return _native_module("build")


def _native_file():
    return _native_module("file_check")


class BuildNativeKernels(build_ext):
    """The native kernels as one shared library (loaded with ctypes, linked against neither
    Python, torch nor an OpenMP runtime): each kernel source compiled once per variant of
    native_build.variants(), one dispatcher binding the CPU's best variant at load time. A
    failed build leaves the package without the library, never the install failed: native/library.py
    then builds the kernels for the machine on first use. The library goes into place with its
    checksum beside it (native/file_check.py), which native/library.py checks before loading it."""

    def get_ext_filename(self, fullname):
        # a plain name, no Python ABI tag: the library is not a Python module (asked by full
        # name or by its last part, as distutils does)
        parts = fullname.split(".")
        if fullname == NATIVE or fullname == NATIVE.split(".")[-1]:
            return os.path.join(*parts[:-1], _native_build().LIBRARY_NAME)
        return super().get_ext_filename(fullname)

    def build_extension(self, ext):
        if ext.name != NATIVE:
            return super().build_extension(ext)
        try:
            self._build_native(ext)
        except Exception as error:  # any compiler failure: the run-time build remains
            self.warn("the native kernels were not built (%s); fairseq_pardec builds them on "
                      "first use where a C compiler is found" % error)

    def _build_native(self, ext):
        build = _native_build()
        temp = Path(self.build_temp) / "pardec_native"
        objects = []
        names = []
        for name, flags in build.variants():
            objects += self.compiler.compile(
                [str(NATIVE_DIR / source) for source in build.KERNEL_SOURCES],
                output_dir=str(temp / name), macros=[("PARDEC_ISA", name)],
                include_dirs=[str(NATIVE_DIR)], extra_postargs=flags + ["-g0"])
            names.append(name)
        objects += self.compiler.compile(
            [str(NATIVE_DIR / source) for source in build.COMMON_SOURCES],
            output_dir=str(temp / "common"),
            macros=[("PARDEC_VARIANTS", build.variants_macro(names)),
                    ("PARDEC_SOURCE_DIGEST", '"%s"' % build.source_digest())],
            include_dirs=[str(NATIVE_DIR)], extra_postargs=["-O2", "-g0"])
        linked = temp / build.LIBRARY_NAME
        self.compiler.link_shared_object(objects, str(linked), libraries=["m"])
        output = Path(self.get_ext_fullpath(ext.name))
        output.parent.mkdir(parents=True, exist_ok=True)
        _native_file().install(linked, output)

    def copy_extensions_to_source(self):
        """An in-place (editable) install: the library copied into the source tree with its
        checksum, renamed into place (distutils' copy rewrites the file where it is: a process
        that has it mapped dies of SIGBUS, and a copy cut short stays). The package's one
        extension is the library."""
        built = Path(self.build_lib) / self.get_ext_filename(NATIVE)
        if built.exists():  # else the build failed: native/library.py builds the kernels on first use
            _native_file().install(built, NATIVE_DIR / _native_build().LIBRARY_NAME)

    def get_outputs(self):
        suffix = _native_file().CHECKSUM_SUFFIX
        outputs = super().get_outputs()
        return outputs + [path + suffix for path in outputs if _is_library(path)]

    def get_output_mapping(self):
        suffix = _native_file().CHECKSUM_SUFFIX
        mapping = super().get_output_mapping()
        mapping.update({built + suffix: placed + suffix
                        for built, placed in list(mapping.items()) if _is_library(built)})
        return mapping


def _is_library(path):
    return os.path.basename(path) == _native_build().LIBRARY_NAME


setup(
    name="fairseq_pardec",
    version="0.1.0",
    description="Blockwise, aggressive (IAD/GAD) and interleaved bidirectional decoding for fairseq",
    packages=find_packages(include=["fairseq_pardec", "fairseq_pardec.*"]),
    # the native kernels: built at install time (BuildNativeKernels); their sources ship too,
    # for the build at run time where the install could not compile them (native/library.py)
    ext_modules=[Extension(NATIVE, sources=[], optional=True)],
    cmdclass={"build_ext": BuildNativeKernels},
    package_data={"fairseq_pardec.native": ["*.c", "*.h"],
                  "fairseq_pardec.serve": ["page.html"]},
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
        # the server (fairseq-pardec-serve)
        "serve": ["fastapi>=0.110", "uvicorn>=0.29", "prometheus_client>=0.20"],
        # the server's tests and its load benchmark's client; playwright drives Debian's
        # chromium for the page's test (skipped where no chromium is found)
        "test": ["pytest>=7", "fastapi>=0.110", "uvicorn>=0.29", "prometheus_client>=0.20",
                 "httpx>=0.27", "playwright>=1.40"],
        # CTranslate2 rows in the benchmark (python -m fairseq_pardec.benchmark --generators ct2)
        "ct2": ["ctranslate2>=4.5,<5"],
    },
    entry_points={"console_scripts": [
        "pardec-benchmark=fairseq_pardec.benchmark:cli_main",
        "fairseq-pardec-serve=fairseq_pardec.serve.__main__:cli_main",
    ]},
)
