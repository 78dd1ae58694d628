"""`logra-export`: a run's checkpoint as a Hugging Face model directory that transformers and vLLM load
(`eval.export`, which `logra-eval` uses too)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

import transformers
from torch.distributed.checkpoint.api import CheckpointException

from logra_rl.config import DTYPES
from logra_rl.eval.export import export_checkpoint, find_checkpoint, one_line
from logra_rl.utils.checkpoint import read_controller_state


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line, as every other `logra-export` error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")


def main(argv: list[str] | None = None) -> None:
    """`logra-export CHECKPOINT OUT_DIR [--dtype D] [--base-model PATH] [--force]`."""
    parser = OneLineParser(
        prog="logra-export",
        description="Write a logra-train checkpoint as a Hugging Face model directory (LoRA adapters merged, the "
        "base model's tokenizer and chat template) that transformers and vLLM load.",
        epilog="Then: transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR), or vllm serve OUT_DIR. "
        "LOGRA_TRACEBACK=1 shows the traceback of an error.",
    )
    parser.add_argument(
        "checkpoint",
        type=Path,
        metavar="CHECKPOINT",
        help="a run directory (outputs/<experiment>/<run>: the checkpoint its checkpoints/latest names, or the newest "
        "intact one before it) or one checkpoint (<run>/checkpoints/step_N)",
    )
    parser.add_argument(
        "out", type=Path, metavar="OUT_DIR", help="the directory to write; one that holds anything needs --force"
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bfloat16",
        help="the weights' dtype (default: bfloat16, as the rollout engines sample; float32: the trainer's "
        "masters exactly)",
    )
    parser.add_argument(
        "--base-model",
        metavar="PATH",
        help="the HF model directory or hub id the run started from: its architecture and tokenizer (default: the "
        "run's own, from its config.yaml)",
    )
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it holds anything")
    args = parser.parse_args(argv)
    transformers.logging.disable_progress_bar()
    try:
        checkpoint, skipped = find_checkpoint(args.checkpoint)
        for line in skipped:
            print(f"logra-export: {line}", file=sys.stderr)
        out = export_checkpoint(checkpoint, args.out, args.dtype, args.base_model, args.force)
    except (ValueError, OSError, CheckpointException) as error:  # the last, a BaseException: a shard unreadable
        if os.environ.get("LOGRA_TRACEBACK"):
            raise
        sys.exit(f"logra-export: {one_line(error, 2000)}")
    step, out, run = read_controller_state(checkpoint)["step"], out.resolve(), checkpoint.resolve().parents[1]
    print(
        f"logra-export: wrote {out} ({args.dtype}, step {step} of {run}); load it with "
        f"AutoModelForCausalLM.from_pretrained({str(out)!r}) or serve it: vllm serve {out}"
    )


if __name__ == "__main__":
    main()
