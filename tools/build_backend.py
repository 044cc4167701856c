"""The course's build backend: setuptools', run on a copy of what the wheel is built from.

setuptools builds in the source folder and leaves `build/` and `mha_derived.egg-info/` there: in
a learner's copy of the course, after `pip install .`, beside their notebooks. An editable
install is built in place, as it must point at the source.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from setuptools import build_meta
from setuptools.build_meta import build_editable, get_requires_for_build_editable  # noqa: F401

# What pyproject.toml's [tool.setuptools] sections build the package from.
SOURCES = ("pyproject.toml", "autograde", "exercises")


@contextlib.contextmanager
def _in_a_copy():
    source = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="mha-derived-build-") as scratch:
        for name in SOURCES:
            if (source / name).is_dir():
                shutil.copytree(source / name, Path(scratch) / name,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints"))
            elif (source / name).is_file():
                shutil.copy2(source / name, Path(scratch) / name)
        os.chdir(scratch)
        try:
            yield
        finally:
            os.chdir(source)


def get_requires_for_build_wheel(config_settings=None):
    with _in_a_copy():
        return build_meta.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_sdist(config_settings=None):
    with _in_a_copy():
        return build_meta.get_requires_for_build_sdist(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    metadata_directory = os.path.abspath(metadata_directory)
    with _in_a_copy():
        return build_meta.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    wheel_directory = os.path.abspath(wheel_directory)
    metadata_directory = metadata_directory and os.path.abspath(metadata_directory)
    with _in_a_copy():
        return build_meta.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    sdist_directory = os.path.abspath(sdist_directory)
    with _in_a_copy():
        return build_meta.build_sdist(sdist_directory, config_settings)
