"""Fixture files in tmp_path, shaped like DAPO-Math-17k and MATH-500 (see math_files.py)."""

import pytest

from tests.data.math_files import write_dapo, write_math500


@pytest.fixture
def dapo_file(tmp_path):
    (tmp_path / "dapo").mkdir()
    return write_dapo(tmp_path / "dapo" / "dapo-math-17k.parquet")


@pytest.fixture
def math500_file(tmp_path):
    (tmp_path / "math500").mkdir()
    return write_math500(tmp_path / "math500" / "test.jsonl")
