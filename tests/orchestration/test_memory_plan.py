"""The memory plan: what each process holds, checked before anything starts; a run that cannot fit stops in
seconds with one line, and `logra-plan` shows the plan without starting anything."""

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from logra_rl.config import RunConfig
from logra_rl.models.footprint import Machine, Part, model_footprint
from logra_rl.models.shapes import GEMMA3_27B, write_model
from logra_rl.orchestration.memory_plan import (
    MemoryPlanError,
    check_memory,
    memory_problem,
    plan_memory,
    with_changes,
)
from logra_rl.train.optimizers import UPDATE_RULES, DenseUpdate, RuleMemory
from logra_rl.utils.memory import GIB
from tests.tiny_models import tiny_qwen3_config

BIN = Path(sys.executable).parent
CPU_HOST = Machine(cuda=False, host=20 * GIB, gpu=None)
H100_NODE = Machine(cuda=True, host=1800 * GIB, gpu=80 * GIB)


def run_config(*overrides: str) -> RunConfig:
    with initialize_config_module(config_module="logra_rl.configs", version_base=None):
        return RunConfig.from_mapping(compose("config", overrides=list(overrides)))


@pytest.fixture()
def model_dir(tmp_path):
    config = tiny_qwen3_config(hidden_size=128, intermediate_size=352, num_hidden_layers=4)
    config.save_pretrained(tmp_path)
    return str(tmp_path)


def parts(process):
    return {part.name: part.nbytes for part in process.parts}


def test_dense_holds_gradients_and_adam_moments_logra_holds_sketches(model_dir):
    logra = run_config("cluster.train_workers=2", "logra.rank=16")
    dense = with_changes(logra, optimizer={"name": "dense"})
    model = model_footprint(model_dir, logra.model.target_modules, "float32")
    logra_rank = parts(plan_memory(logra, model_dir, CPU_HOST).process("train rank"))
    dense_rank = parts(plan_memory(dense, model_dir, CPU_HOST).process("train rank"))
    assert logra_rank["weights"] == dense_rank["weights"] == 4 * model.params / 2  # fp32 masters, sharded
    assert dense_rank["Adam moments"] == 8 * model.params / 2
    assert dense_rank["gradients"] >= 4 * model.params / 2
    # a d_out x r sketch and an r x k_in projection per target in fp32, and one second moment per row
    state = 4 * 16 * (model.target_rows + model.target_cols) + 4 * model.target_rows
    assert logra_rank["LoGRA state"] == state and "Adam moments" not in logra_rank


def test_the_engine_residual_is_two_bytes_per_targeted_weight_with_the_tail(model_dir):
    config = run_config()
    model = model_footprint(model_dir, config.model.target_modules, "float32")
    for residual, size in (("tail", 2), ("float32", 4), ("none", 0)):
        engine = plan_memory(with_changes(config, sync={"residual": residual}), model_dir, CPU_HOST)
        assert parts(engine.process("rollout engine"))["residual"] == size * model.target_params
    fp32 = plan_memory(with_changes(config, rollout={"dtype": "float32"}), model_dir, CPU_HOST)
    assert parts(fp32.process("rollout engine"))["residual"] == 0  # fp32 weights are their own master: no tail
    dense = plan_memory(with_changes(config, optimizer={"name": "dense"}), model_dir, CPU_HOST)
    assert parts(dense.process("rollout engine"))["residual"] == 0  # full resyncs: no merges, no residual
    lora = plan_memory(with_changes(config, optimizer={"name": "lora"}), model_dir, CPU_HOST)
    held = parts(lora.process("rollout engine"))["residual + LoRA bases"]
    assert held == (2 + 4) * model.target_params  # the tail, and the fp32 bases adapter payloads are set from


def test_the_plan_holds_what_the_update_rule_says_it_holds(model_dir, monkeypatch):
    """The plan keeps no table of the update rules: a rule's parts reach every train rank as it names them, its
    payload the driver, and a rule whose payloads merge in place gives the engines their residual."""

    class Momentum(DenseUpdate):
        @staticmethod
        def memory(config, model, sequence, cuda):
            return RuleMemory(state=(Part("momentum", 3 * model.params),), saved_per_token=0, probe=(), payload=1000)

    monkeypatch.setitem(UPDATE_RULES, "dense", Momentum)
    config = run_config("optimizer=dense")
    model = model_footprint(model_dir, config.model.target_modules, "float32")
    plan = plan_memory(config, model_dir, CPU_HOST)
    rank = parts(plan.process("train rank"))
    assert rank["momentum"] == 3 * model.params and "Adam moments" not in rank
    assert rank["activations"] == 0  # what each layer saves is the rule's to say
    assert parts(plan.process("driver + Ray"))["payload (object store)"] == 1000  # rank 0 put it; no driver copy
    assert parts(plan.process("rollout engine"))["residual"] == 2 * model.target_params


def test_generation_buffers_follow_the_datas_longest_prompt(model_dir):
    config = run_config("data.max_prompt_length=1024")
    short = parts(plan_memory(config, model_dir, CPU_HOST, prompt_tokens=64).process("rollout engine"))
    long = parts(plan_memory(config, model_dir, CPU_HOST).process("rollout engine"))
    assert short["KV cache"] < long["KV cache"] and short["prefill"] * 16 == long["prefill"]


def test_one_step_off_the_host_holds_the_engines_generation_and_the_train_step_at_once(model_dir):
    """The synchronous loop's phases never meet, so the host needs its worst phase; one step off the engines
    generate while the ranks train, so the host needs both phases' transients together."""
    synchronous = run_config("data.max_prompt_length=1024")
    overlapped = with_changes(synchronous, algorithm={"max_staleness": 1})
    sync_plan, async_plan = (plan_memory(c, model_dir, CPU_HOST) for c in (synchronous, overlapped))
    host = {plan: next(b.need for b in plan.budgets if b.device == "host") for plan in (sync_plan, async_plan)}

    def held(plan, phase):
        return sum(p.count * p.held(phase) for p in plan.processes)

    assert host[sync_plan] == max(held(sync_plan, phase) for phase in ("loading", "training", "generating", "syncing"))
    engines = async_plan.process("rollout engine")
    together = held(async_plan, "training") - engines.count * (engines.held("training") - engines.held("generating"))
    assert host[async_plan] == pytest.approx(max(host[sync_plan], together))
    assert host[async_plan] > host[sync_plan]  # the engines' KV cache and prefill on top of the train step's


@pytest.fixture()
def gemma3_27b(tmp_path):
    """Gemma 3 27B's text model as a config alone: 62 layers, hidden 5376, vocab 262k, tied embeddings."""
    return str(write_model(dataclasses.replace(GEMMA3_27B, family="gemma3"), tmp_path, weights=False))


def test_the_27b_preset_fits_one_h100_node_with_logra_and_not_with_dense(gemma3_27b):
    config = run_config("+experiment=reasoning_gym_hard_27b", f"model.path={gemma3_27b}")
    logra = plan_memory(config, gemma3_27b, H100_NODE)
    assert logra.fits, logra.rows()
    assert 27e9 < model_footprint(gemma3_27b, config.model.target_modules, "bfloat16").params < 27.1e9
    dense_config = with_changes(config, optimizer={"name": "dense"})
    dense = plan_memory(dense_config, gemma3_27b, H100_NODE)
    assert not dense.fits
    # 16 bytes of fp32 weights, gradients and moments per parameter over 4 GPUs: 108 GB each before activations
    assert dense.process("train rank").peak > 16 * 27e9 / 4
    problem = memory_problem(dense, dense_config, gemma3_27b, H100_NODE)
    assert problem.startswith("memory plan: each train GPU needs") and "80.0 GiB available" in problem
    assert "Fits with optimizer=logra" in problem


PROCESS_GROUP_BUCKET = "resync bucket (process group)"


def test_a_resync_through_the_process_group_holds_its_largest_bucket_at_both_ends(model_dir):
    """sync.resync_route=process_group: train rank 0 packs each bucket into one flat tensor and every engine
    process receives it whole; no bucket is larger than the model. The object store's route holds neither."""
    name = PROCESS_GROUP_BUCKET
    config = run_config("cluster.train_workers=2")
    assert not any(part.name == name for p in plan_memory(config, model_dir, CPU_HOST).processes for part in p.parts)
    plan = plan_memory(with_changes(config, sync={"resync_route": "process_group"}), model_dir, CPU_HOST)
    model = model_footprint(model_dir, config.model.target_modules, "float32")
    assert parts(plan.process("train rank 0"))[name] == 4 * model.params  # the whole tiny model is under 128 MB
    assert parts(plan.process("rollout engine"))[name] == 4 * model.params
    assert name not in parts(plan.process("train rank"))


def test_gemma3_27bs_embedding_is_a_process_group_bucket_of_its_own_on_each_gpu(gemma3_27b):
    """On GPUs the bucket sits on train rank 0's host and GPU and on every rollout GPU; Gemma 3's 262k × 5376
    embedding, 5.6 GB of fp32, is the largest bucket, whatever sync.bucket_mb says."""
    name = PROCESS_GROUP_BUCKET
    gemma = run_config("+experiment=reasoning_gym_hard_27b", f"model.path={gemma3_27b}")
    routed = with_changes(gemma, sync={"resync_route": "process_group"})
    plan, before = plan_memory(routed, gemma3_27b, H100_NODE), plan_memory(gemma, gemma3_27b, H100_NODE)
    model = model_footprint(gemma3_27b, gemma.model.target_modules, "bfloat16")
    embedding = 4 * model.vocab * model.hidden
    assert 5.6e9 < embedding < 5.7e9
    engine = plan.process("rollout engine")
    assert parts(engine)[name] == embedding
    assert engine.held("syncing") == before.process("rollout engine").held("syncing") + embedding
    sent = [part for part in plan.process("train rank 0").parts if part.name == name]
    assert sorted((part.on_host, part.nbytes) for part in sent) == [(False, embedding), (True, embedding)]
    assert plan.fits, plan.rows()
    # vLLM given 0.8 of each GPU: the bucket no longer fits beside it, and the object store's route is what does
    crowded = with_changes(routed, rollout={"gpu_memory_utilization": 0.8})
    problem = memory_problem(plan_memory(crowded, gemma3_27b, H100_NODE), crowded, gemma3_27b, H100_NODE)
    assert problem.startswith("memory plan: each rollout GPU needs")
    assert "Fits with sync.resync_route=object_store" in problem


def test_check_memory_refuses_or_warns_as_configured(model_dir, capsys):
    from rich.console import Console

    config = run_config("cluster.host_memory_gib=0.5")
    with pytest.raises(MemoryPlanError, match=r"memory plan: host needs [\d.]+ GiB, 0.5 GiB available"):
        check_memory(config, model_dir, Console())
    plan = check_memory(with_changes(config, cluster={"memory_check": False}), model_dir, Console())
    assert not plan.fits and "Running anyway: cluster.memory_check=false" in capsys.readouterr().out


def run_program(program: str, args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / program), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_a_run_that_cannot_fit_stops_in_seconds_with_one_line(tmp_path):
    start = time.perf_counter()
    args = ["optimizer=dense", "cluster.host_memory_gib=1", "trainer.run_name=nofit"]
    result = run_program("logra-train", args, tmp_path)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("logra-train: MemoryPlanError: memory plan: host needs"), result.stderr[-2000:]
    assert "1.0 GiB available" in last and "cluster.memory_check=false runs anyway" in last
    assert "Traceback" not in result.stderr
    assert time.perf_counter() - start < 60
    assert not list(tmp_path.rglob("metrics.jsonl"))  # nothing ran


def test_logra_plan_prints_the_plan_and_starts_nothing(tmp_path):
    result = run_program("logra-plan", ["trainer.prompts_per_step=64"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    for row in ("train rank 0", "rollout engine", "driver + Ray", "host needs"):
        assert row in result.stdout
    assert list(tmp_path.iterdir()) == []  # no run directory, no model built here
    refused = run_program("logra-plan", ["cluster.host_memory_gib=0.1"], tmp_path)
    assert refused.returncode == 1 and "logra-plan: memory plan: host needs" in refused.stderr
