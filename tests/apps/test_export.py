"""`logra-export` on a real run's checkpoints, as a user runs it: the HF directory it writes holds the trainer's
weights (bf16: each fp32 master rounded; float32: bit for bit) with the tokenizer and chat template, and every bad
input is one line on stderr, nothing written."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.runs import run_to_the_end

LOGRA_EXPORT = str(Path(sys.executable).parent / "logra-export")


def logra_export(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([LOGRA_EXPORT, *map(str, args)], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, quickstart_model) -> Path:
    """A 2-step quickstart-model run with a checkpoint after each step (step_1, step_2; latest: step_2)."""
    cwd = tmp_path_factory.mktemp("run")
    args = ["model=hf", f"model.path={quickstart_model}", "logra=quickstart", "trainer.prompts_per_step=16"]
    args += ["trainer.total_steps=2", "trainer.checkpoint_every=1", "eval.every=0"]
    run_to_the_end([*args, "logger.progress=false", "logger.plot=false"], cwd, "export")
    return cwd / "outputs/quickstart/export"


def checkpoint_state(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The trainer's fp32 masters under HF names, read with torch's own converter."""
    dcp_to_torch_save(checkpoint / "model", scratch / "state.pt")
    return torch.load(scratch / "state.pt", weights_only=False)["model"]


def test_the_export_holds_the_trainers_weights_and_loads_with_its_chat_template(run_dir, quickstart_model, tmp_path):
    state = checkpoint_state(run_dir / "checkpoints/step_2", tmp_path)
    out = tmp_path / "exported"
    result = logra_export(run_dir, out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("\n") == 1 and str(out) in result.stdout and "step 2" in result.stdout
    assert "bfloat16" in result.stdout and f"vllm serve {out}" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "state.pt"]  # no temporary directory left
    assert all(file.stat().st_mode & 0o044 == 0o044 for file in out.iterdir())  # readable by a server's user

    weights = load_file(out / "model.safetensors")
    assert weights.keys() == state.keys()
    assert all(torch.equal(weights[k], state[k].to(torch.bfloat16)) for k in state)  # each master rounded, once
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"

    tokenizer = AutoTokenizer.from_pretrained(out)
    chats = [[{"role": "user", "content": f"{a}+1=?"}] for a in range(4)]
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    assert prompts == [f"<|im_start|>user\n{a}+1=?<|im_end|>\n<|im_start|>assistant\n" for a in range(4)]
    ids = torch.tensor([tokenizer(p)["input_ids"] for p in prompts])
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.dtype == torch.bfloat16
    trained = AutoModelForCausalLM.from_pretrained(quickstart_model, dtype=torch.float32)
    trained.load_state_dict(state, strict=True)
    for parameter in trained.parameters():  # cast as bf16 loading casts: the rotary frequencies stay fp32
        parameter.data = parameter.data.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, trained(input_ids=ids).logits)

    result = logra_export(run_dir / "checkpoints/step_2", out, "--dtype", "float32", "--force")
    assert result.returncode == 0, result.stderr[-3000:]
    weights = load_file(out / "model.safetensors")
    assert all(torch.equal(weights[k], state[k]) for k in state)  # the masters bit for bit
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "state.pt"]  # the old export replaced


def test_a_run_directory_gives_its_newest_intact_checkpoint_and_its_own_base_model(run_dir, quickstart_model, tmp_path):
    """As `logra-train` with no arguments runs: the quickstart builder's base model in `<run>/base_model`."""
    copy = shutil.copytree(run_dir, tmp_path / "run")
    config = OmegaConf.load(copy / "config.yaml")
    config.model.path, config.model.builder = None, "quickstart"
    OmegaConf.save(config, copy / "config.yaml")
    shutil.copytree(quickstart_model, copy / "base_model")
    shard = copy / "checkpoints/step_2/model/__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    result = logra_export(copy, tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 1" in result.stdout and "step_2 is damaged (model/__0_0.distcp is 100 of" in result.stderr
    state = checkpoint_state(copy / "checkpoints/step_1", tmp_path)
    weights = load_file(tmp_path / "out/model.safetensors")
    assert all(torch.equal(weights[k], state[k].to(torch.bfloat16)) for k in state)


# Each bad input, set up under tmp_path: the arguments, and what the one line says.
def not_a_run(run_dir: Path, tmp_path: Path) -> tuple[list, str]:
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("")
    return [notes, tmp_path / "out"], "notes is neither a run directory (no checkpoints/) nor a checkpoint (no model/)"


def damaged(run_dir: Path, tmp_path: Path) -> tuple[list, str]:
    copy = shutil.copytree(run_dir / "checkpoints/step_2", tmp_path / "run/checkpoints/step_2")
    shard = copy / "model/__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    return [copy, tmp_path / "out"], "step_2 is damaged (model/__1_0.distcp is "


def existing_out(run_dir: Path, tmp_path: Path) -> tuple[list, str]:
    (tmp_path / "out").mkdir()
    (tmp_path / "out/mine.txt").write_text("keep me")
    return [run_dir, tmp_path / "out"], "out exists and is not empty; choose another OUT_DIR, or pass --force"


def base_model_gone(run_dir: Path, tmp_path: Path) -> tuple[list, str]:
    copy = shutil.copytree(run_dir, tmp_path / "run", ignore=shutil.ignore_patterns("step_1"))
    config = OmegaConf.load(copy / "config.yaml")
    config.model.path = str(tmp_path / "gone")  # a base model deleted since the run
    OmegaConf.save(config, copy / "config.yaml")
    return [copy, tmp_path / "out"], "gone is missing; pass --base-model DIR"


def no_checkpoint(run_dir: Path, tmp_path: Path) -> tuple[list, str]:
    (tmp_path / "run/checkpoints/step_3.tmp").mkdir(parents=True)  # a save that was interrupted
    return [tmp_path / "run", tmp_path / "out"], "run has no checkpoint (its checkpoints/ holds ['step_3.tmp'])"


def bad_dtype(run_dir: Path, tmp_path: Path) -> tuple[list, str]:
    return [run_dir, tmp_path / "out", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"


@pytest.mark.parametrize("case", [not_a_run, damaged, existing_out, base_model_gone, no_checkpoint, bad_dtype])
def test_a_bad_input_is_one_line_and_writes_nothing(run_dir, tmp_path, case):
    args, said = case(run_dir, tmp_path)
    before = sorted(tmp_path.rglob("*"))
    result = logra_export(*args, timeout=15)
    assert result.returncode != 0
    assert result.stderr.startswith("logra-export: ") and result.stderr.count("\n") == 1, result.stderr
    assert said in result.stderr and "Traceback" not in result.stderr
    assert sorted(tmp_path.rglob("*")) == before  # OUT_DIR untouched, no temporary directory
    if case is existing_out:
        assert (tmp_path / "out/mine.txt").read_text() == "keep me"


def test_help_describes_the_command(capsys):
    from logra_rl.apps.export import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    said = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert "Hugging Face model directory" in said and "--dtype {float32,bfloat16,float16}" in said
    assert "vllm serve OUT_DIR" in said
