"""FSDP2 on 2 gloo ranks: reduced sketches, directions, KL probe and committed weights equal one process; under
bf16 mixed precision the guard's trial forward is the committed model's forward, bit for bit."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from logra_rl.logra import KLRows, LoGRAConfig, LoGRAOptimizer, jvp_kl, reduced_mean_kl
from tests.tiny_models import random_batch, tiny_qwen3, token_sum_loss

REPO = Path(__file__).resolve().parents[2]
MODEL_SEED = 6
CONFIG = {"rank": 8, "seed": 11, "update_ratio": 1e-3}
ALPHA = 1.5
TEMPERATURE = 1.0
GLOBAL_BATCH = random_batch(4, 20, seed=3)
LOSS_MASK = (torch.arange(20) >= 5).long().expand(4, 20)
NUM_TOKENS = GLOBAL_BATCH[:, 1:].numel()


def single_process_step():
    model = tiny_qwen3(seed=MODEL_SEED)
    opt = LoGRAOptimizer(model, LoGRAConfig(**CONFIG))
    for row in GLOBAL_BATCH.split(1):
        token_sum_loss(model, row).backward()
    opt.prepare(num_tokens=NUM_TOKENS)
    sketches = [t.sketch.clone() for t in opt.targets]
    directions = [d.clone() for _, _, d in opt.proposal()]
    # under FSDP each rank probes its first probe_responses (2) rows: all 4 rows of the global batch
    rows = KLRows(lambda ids: model(input_ids=ids).logits, GLOBAL_BATCH, LOSS_MASK)
    q = reduced_mean_kl(*jvp_kl(rows, opt.proposal(), TEMPERATURE))
    projections = [t.projection.clone() for t in opt.targets]
    factors = [entry.factor for entry in opt.commit(ALPHA).entries]
    return opt, model, sketches, directions, q, projections, factors


def test_fsdp2_step_matches_single_process(tmp_path):
    out = tmp_path / "fsdp.pt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    # a new session, so a hang kills torchrun's workers too, not only the launcher
    process = subprocess.Popen(
        [*command, str(REPO / "tests/logra/fsdp_worker.py"), str(out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    assert process.returncode == 0, stderr[-3000:]
    sharded = torch.load(out, weights_only=True)
    opt, _, sketches, directions, q, projections, factors = single_process_step()

    assert sharded["names"] == [t.name for t in opt.targets]
    for name, a, b in zip(sharded["names"], sharded["sketches"], sketches, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6, msg=name)
    for a, b in zip(sharded["directions"], directions, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-9)
    assert abs(sharded["q"] - q) / q < 1e-5
    # U = bf16(α·D): directions summed in another order may round to the neighbouring bf16 value, no further
    for a, b in zip(sharded["factors"], factors, strict=True):
        assert a.dtype == b.dtype == torch.bfloat16
        assert bool(((a.float() - b.float()).abs() <= b.float().abs() * 2**-7).all())  # one bf16 ulp at most
    # every rank merged its own rows with the group's one U: W = W0 − U·A on every target, W0 elsewhere
    initial = tiny_qwen3(seed=MODEL_SEED).state_dict()
    merged = zip(opt.targets, sharded["factors"], projections, strict=True)
    step = {f"{t.name}.weight": u.float() @ a for t, u, a in merged}
    for name, weight in initial.items():
        expected = weight - step[name] if name in step else weight
        torch.testing.assert_close(sharded["weights"][name], expected, rtol=1e-6, atol=1e-8, msg=name)

    # each rank changed exactly its own row block; together they cover every row once
    for target in opt.targets:
        rank0, rank1 = (set(changed[target.name]) for changed in sharded["changed_by_rank"])
        assert rank0 and rank1 and not rank0 & rank1
        assert rank0 | rank1 == set(range(target.out_features))
        assert max(rank0) < min(rank1)

    # bf16 compute with fp32 masters: the same sketch to bf16 accuracy, and fp32 weights that moved
    torch.testing.assert_close(sharded["bf16_sketch"], sketches[0], rtol=0.05, atol=0.05 * sketches[0].abs().max())
    moved = sharded["bf16_weights"]["model.layers.0.self_attn.q_proj.weight"]
    assert moved.dtype == torch.float32
    assert not torch.equal(moved, tiny_qwen3(seed=MODEL_SEED).state_dict()["model.layers.0.self_attn.q_proj.weight"])
    # the trial: each decoder layer's bf16 all-gather carried the merged rows, then every row came back
    assert sharded["trial_restored"] and sharded["trial_equals_commit"] and sharded["trial_moved"]
    assert sharded["per_try_equals_commit"]  # merged once into every unit: the same bits, for every forward
