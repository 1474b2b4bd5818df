"""Builds ``libascend_pd`` with cargo and ships it inside the package.

The crate is the repository root, one directory above this file, so the
package installs from a checkout (``pip install ./python``), not from an
sdist. The library is a plain C library loaded with ctypes, not a Python
extension module: it keeps cargo's file name and the wheel is tagged
``py3-none-<platform>`` (any Python 3, this platform). The version is the
crate's, read from ../Cargo.toml.
"""

import os
import re
import sys

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools_rust import Binding, RustExtension
from setuptools_rust.build import build_rust

if sys.version_info >= (3, 11):
    import tomllib
else:  # pyproject.toml's build requirements add tomli there
    import tomli as tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
MANIFEST = os.path.join(HERE, "..", "Cargo.toml")
LIBRARY = "libascend_pd.so"

if not os.path.isfile(MANIFEST):
    raise SystemExit(
        f"ascend-pd builds libascend_pd from the Rust crate in {os.path.dirname(MANIFEST)}, "
        "which is not there: install the package from an ascend-pd checkout "
        "(`pip install ./python`), not from an sdist."
    )


def crate_version() -> str:
    """The package's version: the crate's (``[package] version`` of
    ../Cargo.toml, or ``[workspace.package]``'s where the crate inherits it).

    Cargo's ``1.2.0-rc.1`` becomes PEP 440's ``1.2.0rc1`` in the wheel
    (setuptools normalizes it)."""
    with open(MANIFEST, "rb") as f:
        cargo = tomllib.load(f)
    version = cargo.get("package", {}).get("version")
    if isinstance(version, dict) and version.get("workspace") is True:
        version = cargo.get("workspace", {}).get("package", {}).get("version")
    if not isinstance(version, str) or not version:
        raise SystemExit(f"{MANIFEST}: no [package] version to give the Python package")
    return version


VERSION = crate_version()

# ascend_pd.__version__, where the package spells it out, must say the same.
with open(os.path.join(HERE, "ascend_pd", "__init__.py"), encoding="utf-8") as f:
    _spelled = re.search(r"""^__version__\s*=\s*["']([^"']*)["']""", f.read(), re.M)
if _spelled and _spelled.group(1) != VERSION:
    raise SystemExit(
        f"ascend_pd/__init__.py says __version__ = {_spelled.group(1)!r} but "
        f"{os.path.normpath(MANIFEST)} says version = {VERSION!r}: they must agree"
    )


class build_rust_cdylib(build_rust):
    """``build_rust`` that keeps the library's own name (no ``.cpython-311-...`` suffix)."""

    def get_dylib_ext_path(self, ext: RustExtension, target_fname: str) -> str:
        path = super().get_dylib_ext_path(ext, target_fname)
        return os.path.join(os.path.dirname(path), LIBRARY)


class bdist_wheel_any_python(bdist_wheel):
    """The library does not link libpython: one wheel serves every Python 3."""

    def get_tag(self) -> "tuple[str, str, str]":
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(
    version=VERSION,
    rust_extensions=[
        RustExtension(
            "ascend_pd.libascend_pd",
            path=MANIFEST,
            binding=Binding.NoBinding,
            # `cargo rustc --lib --release --crate-type lib,cdylib`: the crate
            # types of Cargo.toml, so cargo sees the same unit as
            # `cargo build --release --lib` and an already-built library in
            # the repository's target/ is reused as is (setuptools-rust's
            # default `--crate-type cdylib` would recompile the crate).
            args=["--crate-type", "lib,cdylib"],
            debug=False,
        )
    ],
    cmdclass={"build_rust": build_rust_cdylib, "bdist_wheel": bdist_wheel_any_python},
    zip_safe=False,
)
