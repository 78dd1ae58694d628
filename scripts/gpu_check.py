#!/usr/bin/env python3
"""The GPU check (`logra-gpu-check`, logra_rl/apps/gpu_check.py) from a copy of the repository with nothing installed:
a bare GPU machine has torch and transformers but not the project, so this finds the project from its own path.

    python scripts/gpu_check.py --out DIR                        # one CUDA GPU, Qwen2.5-7B shapes
    python scripts/gpu_check.py --device cpu --small --out DIR   # the same code paths on a CPU, small shapes (CI)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project, without PYTHONPATH or an install

from logra_rl.apps.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
