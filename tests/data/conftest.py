"""Fixture files in tmp_path, shaped like DAPO-Math-17k and MATH-500 (see math_files.py)."""

import json

import datasets
import pytest

from tests.data.math_files import DAPO_COPIES, DAPO_PROBLEMS, MATH500_ROWS, dapo_record


@pytest.fixture
def dapo_file(tmp_path):
    rows = [dapo_record(p, a, i) for i, (p, a) in enumerate(DAPO_PROBLEMS * DAPO_COPIES)]
    path = tmp_path / "dapo" / "dapo-math-17k.parquet"
    path.parent.mkdir()
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


@pytest.fixture
def math500_file(tmp_path):
    path = tmp_path / "math500" / "test.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(row) + "\n" for row in MATH500_ROWS))
    return str(path)
