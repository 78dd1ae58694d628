"""`logra-fetch-smollm2 [--out DIR]`: SmolLM2-135M-Instruct as a normal HF directory, built once (`models.smollm2`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from logra_rl.models import smollm2


def main(argv: list[str] | None = None) -> None:
    """`logra-fetch-smollm2 [--out DIR]`: build (or find) the model and print its directory."""
    parser = argparse.ArgumentParser(prog="logra-fetch-smollm2", description=smollm2.__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help=f"default: {smollm2.default_model_dir()}")
    args = parser.parse_args(argv)
    try:
        print(smollm2.fetch_smollm2(args.out))
    except (OSError, ImportError) as error:
        sys.exit(f"logra-fetch-smollm2: {error}")


if __name__ == "__main__":
    main()
