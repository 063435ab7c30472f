"""Builds libmaru.so from ../../libmaru with cargo (setuptools-rust, no Python binding:
a plain cdylib loaded with ctypes) into the package as maru/libmaru.*.so.

MARU_WHEEL_DEBUG=1 builds cargo's debug profile (the tests do, to reuse their build);
the default is release. CARGO_TARGET_DIR picks cargo's output directory as usual.
"""

import os
from pathlib import Path

from setuptools import setup
from setuptools_rust import Binding, RustExtension

here = Path(__file__).resolve().parent
manifest = here.parent.parent / "libmaru" / "Cargo.toml"
if not manifest.is_file():
    raise SystemExit(
        f"{manifest} not found: build the maru package from a checkout of the Maru repository "
        "(pip install ./bindings/python), which holds the Rust sources of libmaru"
    )

setup(
    rust_extensions=[
        RustExtension(
            "maru.libmaru",
            path=str(manifest),
            binding=Binding.NoBinding,
            debug=os.environ.get("MARU_WHEEL_DEBUG") == "1",
            # Pure C ABI: one wheel serves every CPython version.
            py_limited_api=True,
        )
    ],
)
