"""One LoGRA step under FSDP2 on gloo ranks; run by tests/logra/test_fsdp.py through torchrun.

Rank r trains on rows [2r, 2r+2) of the global batch, one row per microbatch. Rank 0 writes
what the test compares with a single-process run: reduced sketches, directions, the KL probe,
the committed factors U and full weights, and which global rows each rank changed.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from logra_rl.logra import KLRows, LoGRAConfig, LoGRAOptimizer
from logra_rl.utils.shards import local_rows
from tests.logra.test_fsdp import ALPHA, CONFIG, GLOBAL_BATCH, LOSS_MASK, MODEL_SEED, NUM_TOKENS, TEMPERATURE
from tests.tiny_models import tiny_qwen3, token_sum_loss


def sharded_model(mixed_precision: bool):
    model = tiny_qwen3(seed=MODEL_SEED)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    kwargs = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def local_batch() -> tuple[torch.Tensor, torch.Tensor]:
    rank = dist.get_rank()
    return GLOBAL_BATCH[2 * rank : 2 * rank + 2], LOSS_MASK[2 * rank : 2 * rank + 2]


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = sharded_model(mixed_precision=False)
    opt = LoGRAOptimizer(model, LoGRAConfig(**CONFIG))
    rows, mask = local_batch()
    for row in rows.split(1):
        token_sum_loss(model, row).backward()
    opt.prepare(num_tokens=NUM_TOKENS)
    sketches = [t.sketch.clone() for t in opt.targets]
    directions = [d.clone() for _, _, d in opt.proposal()]
    q = opt.probe_kl(KLRows(lambda ids: model(input_ids=ids).logits, rows, mask), TEMPERATURE)

    before = {t.name: local_rows(t.module.weight)[0].clone() for t in opt.targets}
    payload = opt.commit(ALPHA)
    changed = {}
    for t in opt.targets:
        local, offset = local_rows(t.module.weight)
        moved = (local != before[t.name]).any(dim=1).nonzero().flatten() + offset
        changed[t.name] = moved.tolist()
    changed_by_rank = [None] * dist.get_world_size()
    dist.all_gather_object(changed_by_rank, changed)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    # the same step with bf16 compute (FSDP2 mixed precision) and fp32 masters
    bf16_model = sharded_model(mixed_precision=True)
    bf16_opt = LoGRAOptimizer(bf16_model, LoGRAConfig(**CONFIG))
    for row in rows.split(1):
        token_sum_loss(bf16_model, row).backward()
    bf16_opt.prepare(num_tokens=NUM_TOKENS)
    bf16_sketch = bf16_opt.targets[0].sketch.clone()
    masters = [local_rows(t.module.weight)[0].clone() for t in bf16_opt.targets]
    with torch.no_grad():
        unstepped = bf16_model(input_ids=rows).logits
        with bf16_opt.trial(ALPHA):
            trial = bf16_model(input_ids=rows).logits
        restored = all(
            torch.equal(local_rows(t.module.weight)[0], m) for t, m in zip(bf16_opt.targets, masters, strict=True)
        )
        with bf16_opt.trial(ALPHA, per_try=True):  # merged once, for two forwards
            per_try = [bf16_model(input_ids=rows).logits for _ in range(2)]
    restored = restored and all(
        torch.equal(local_rows(t.module.weight)[0], m) for t, m in zip(bf16_opt.targets, masters, strict=True)
    )
    bf16_opt.commit(ALPHA)
    with torch.no_grad():
        committed = bf16_model(input_ids=rows).logits
    bf16_full = get_model_state_dict(bf16_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    if rank == 0:
        torch.save(
            {
                "names": [t.name for t in opt.targets],
                "sketches": sketches,
                "directions": directions,
                "q": q,
                "weights": full,
                "factors": [entry.factor for entry in payload.entries],
                "changed_by_rank": changed_by_rank,
                "bf16_sketch": bf16_sketch,
                "bf16_weights": bf16_full,
                "trial_restored": restored,
                "trial_equals_commit": torch.equal(trial, committed),
                "per_try_equals_commit": all(torch.equal(logits, committed) for logits in per_try),
                "trial_moved": not torch.equal(trial, unstepped),
            },
            out_path,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
