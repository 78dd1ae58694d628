"""What only a GPU can show, in one short run: prints a table, writes JSON, fails on any failed check.

    python scripts/gpu_check.py --out DIR                        # on one CUDA GPU, a few minutes
    python scripts/gpu_check.py --device cpu --small --out DIR   # the same code paths on a CPU, small shapes

It needs only torch, transformers, peft, safetensors, numpy and psutil (what a bare GPU machine
has: no Hydra, OmegaConf, Ray or vLLM), and finds the project from its own path. It writes
DIR/gpu_check.json, prints one line per failed check and exits 1 if any failed.

1. FSDP2 (nccl on CUDA) with bf16 compute and fp32 masters: one LoGRA step; the bf16-autocast
   sketches vs the fp32 dense gradient sketched with the same A (relative error).
2. Kernels: forward + backward of one decoder layer with LoGRA sketches vs with dense weight
   gradients; the JVP KL probe.
3. Peak memory of one full training step, dense AdamW vs LoGRA (r = 64, 256), on a
   Qwen2.5-1.5B-shaped model (fp32 masters, bf16 autocast, activation checkpointing).
4. In-place apply of one payload into a Qwen2.5-7B-shaped decoder layer (bf16 + fp32 residual), and
   its bit-equality with the trainer-side merge of the same updates cut into other row shards and chunks.
5. TrainWorker set-up on the device: rank-0 load, meta-device build, FSDP2, broadcast of the
   shards and buffers; its full state (and its resync buckets) must equal the checkpoint exactly,
   and its log-probs (fp32 compute) must match a plain fp32 model's.

6. Projections drawn on the device vs on the CPU, and one whole-model redraw on the device.
7. KL under bf16 autocast: the finite-difference q and the realised KL against the fp32 JVP and
   the fp32 realised KL; on CUDA, a CUDA graph captured around a linear replays an in-place merge;
   the 7B-shaped peak memory of dense AdamW vs LoGRA (an out-of-memory is recorded as "OOM").

Checks (each must hold): worker state and buckets exact; worker log-probs within 1e-3 of the
reference; bf16 sketch error below 5% of the fp32 dense gradient's sketch; the in-place apply's
bf16 weights equal bf16 of an fp32 master merged the trainer's way, bit for bit; device projections
equal the CPU's; bf16 KLs within 0.8–1.25 of fp32; on CUDA, the graph replay sees the merge, and
the peak memory of a LoGRA step is below the dense AdamW step's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project, without PYTHONPATH or an install

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import Qwen2Config, Qwen2ForCausalLM

from logra_rl.logra import (
    LoGRAConfig,
    LoGRAOptimizer,
    PayloadEntry,
    PayloadMerger,
    UpdatePayload,
    hf_targets,
    make_projection,
    merge_low_rank_,
    projection_fingerprint,
)

GIB = 2**30
SHAPES = {
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    ),
}


def model_of(shape: dict, layers: int | None = None) -> Qwen2ForCausalLM:
    config = Qwen2Config(**{**shape, **({"num_hidden_layers": layers} if layers else {})}, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).float()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int = 3) -> float:
    fn()  # warm-up
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeats


def loss_of(model, ids, dtype):
    with torch.autocast(ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum"
    )


def sketch_vs_dense(device: torch.device, shape: dict, tokens: int) -> float:
    """Max relative error of bf16-autocast sketches vs the fp32 dense gradient times Aᵀ (2 layers)."""
    torch.manual_seed(1)
    model = model_of(shape, layers=2).to(device)
    twin = model_of(shape, layers=2).to(device)
    twin.load_state_dict(model.state_dict())
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=64))
    ids = torch.randint(0, shape["vocab_size"], (1, tokens), device=device)
    loss_of(model, ids, torch.bfloat16).backward()
    loss_of(twin, ids, torch.float32).backward()
    modules = dict(twin.named_modules())
    worst = 0.0
    for target in opt.targets:
        expected = modules[target.name].weight.grad @ target.projection.t()
        worst = max(worst, float((target.sketch - expected).norm() / expected.norm()))
    return worst


def check_kernels(device: torch.device, shape: dict, tokens: int, dtype: torch.dtype) -> dict:
    """One decoder layer: forward + backward with sketches vs with weight gradients; the JVP probe."""
    torch.manual_seed(2)
    dense = model_of(shape, layers=1).to(device)
    logra = model_of(shape, layers=1).to(device)
    opt = LoGRAOptimizer(logra, LoGRAConfig(rank=64))
    ids = torch.randint(0, shape["vocab_size"], (1, tokens), device=device)

    def step(model):
        return lambda: loss_of(model, ids, dtype).backward()

    result = {"layer_fwd_bwd_dense_s": timed(step(dense), device), "layer_fwd_bwd_logra_s": timed(step(logra), device)}
    opt.prepare(num_tokens=tokens)
    mask = torch.ones_like(ids)
    result["jvp_probe_s"] = timed(lambda: opt.probe_kl(lambda x: logra(input_ids=x).logits, ids, mask, 1.0), device)
    opt.discard()
    return result


def peak_memory(device: torch.device, shape: dict, tokens: int, variant: str) -> float:
    """Peak GiB of one forward + backward + update (cuda: allocator peak; cpu: not measured)."""
    if device.type != "cuda":
        return float("nan")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    model = model_of(shape).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, shape["vocab_size"], (1, tokens), device=device)
    if variant == "dense":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.95), fused=True)
        loss_of(model, ids, torch.bfloat16).backward()
        optimizer.step()
    else:
        opt = LoGRAOptimizer(model, LoGRAConfig(rank=int(variant.split("=")[1])))
        loss_of(model, ids, torch.bfloat16).backward()
        opt.prepare(num_tokens=tokens)
        opt.commit(1.0)
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) / GIB
    del model
    return peak


def apply_time(device: torch.device, shape: dict, rank: int) -> dict:
    """One payload into the 7 targets of one decoder layer: bf16 weights + fp32 residual, in place."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // heads
    shapes = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv * d, h),
        "self_attn.v_proj": (kv * d, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    names = {f"model.layers.0.{leaf}": s for leaf, s in shapes.items()}
    masters = {name: torch.randn(s, device=device) * 0.02 for name, s in names.items()}  # the trainer's fp32
    weights = {name: master.to(torch.bfloat16) for name, master in masters.items()}
    merger = PayloadMerger(hf_targets(weights, "float32"), chunk_rows=4096)
    merger.resync(masters, version=0)
    entries = tuple(
        PayloadEntry(name, s[0], s[1], (torch.randn(s[0], rank, device=device) * 1e-4).to(torch.bfloat16))
        for name, s in names.items()
    )

    def payload(version):
        draft = UpdatePayload(version, version + 1, 1, version, rank, "rademacher", "bfloat16", "", entries)
        return UpdatePayload(
            version,
            version + 1,
            1,
            version,
            rank,
            "rademacher",
            "bfloat16",
            projection_fingerprint(draft.projection(entries[0])),
            entries,
        )

    payloads = [payload(v) for v in range(4)]
    merger.apply(payloads[0])  # warm-up
    sync(device)
    start = time.perf_counter()
    for p in payloads[1:]:
        merger.apply(p)
    sync(device)
    seconds = (time.perf_counter() - start) / 3
    generation = timed(lambda: [payloads[0].projection(e) for e in entries], device, repeats=1)
    for p in payloads:  # the trainer's side of the same four updates: 3 uneven FSDP-like row shards, other chunks
        for entry in p.entries:
            master, projection = masters[entry.name], p.projection(entry, device)
            bounds = [0, master.shape[0] // 3 + 1, 2 * master.shape[0] // 3 + 5, master.shape[0]]
            for start, stop in itertools.pairwise(bounds):
                shard = slice(start, stop)
                merge_low_rank_(master[shard], entry.factor[shard], projection, chunk_rows=1000, row_offset=start)
    exact = all(torch.equal(merger.targets[n].weight, masters[n].to(torch.bfloat16)) for n in names)
    return {
        "rank": rank,
        "apply_s": seconds,
        "projection_generation_s": generation,
        "params": sum(s[0] * s[1] for s in names.values()),
        "exact": exact,
    }


def projections_on_device(device: torch.device, shape: dict) -> dict:
    """A drawn on the device equals A drawn on the CPU bit for bit; the time of one whole-model redraw."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    exact = all(
        torch.equal(make_projection(64, k, seed=k + 1, device=device).cpu(), make_projection(64, k, seed=k + 1))
        for k in (h, i)
    )
    per_layer = [h] * 6 + [i]  # q, k, v, gate, up (k_in = hidden) and o (hidden), down (intermediate)
    redraw = timed(
        lambda: [make_projection(256, k, seed=n, device=device) for n, k in enumerate(per_layer)], device, repeats=1
    )
    return {"projection_device_exact": exact, "projection_redraw_model_s": redraw * shape["num_hidden_layers"]}


def kl_under_bf16(device: torch.device, shape: dict, tokens: int) -> dict:
    """q from the fp32 JVP vs the finite-difference probe and the realised KL under bf16 autocast."""
    torch.manual_seed(4)
    model = model_of(shape, layers=2).to(device)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=64))
    ids = torch.randint(0, shape["vocab_size"], (2, tokens), device=device)
    loss_of(model, ids, torch.float32).backward()
    opt.prepare(num_tokens=ids.numel())
    mask = torch.ones_like(ids)

    def bf16(x):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return model(input_ids=x).logits

    fp32 = lambda x: model(input_ids=x).logits  # noqa: E731
    jvp = opt.probe_kl(fp32, ids, mask, 1.0)
    realised = opt.realized_kl(fp32, ids, mask, 1.0, 1.0)
    opt.config = LoGRAConfig(rank=64, kl={"estimator": "finite_difference"})
    finite_difference = opt.probe_kl(bf16, ids, mask, 1.0)
    realised_bf16 = opt.realized_kl(bf16, ids, mask, 1.0, 1.0)
    # The KL guard under bf16: its realised KL comes from the JVP's bf16 primal pass kept as the unstepped
    # forward, the step enlarged to be resolved; it must equal the fp32 KL of the α it chose.
    opt.config = LoGRAConfig(rank=64)
    guarded = opt.guarded_step(bf16, ids, mask, 1.0, budget=jvp)
    guarded_fp32 = opt.realized_kl(fp32, ids, mask, 1.0, guarded.alpha)
    opt.discard()
    return {
        "kl_fd_bf16_over_jvp_fp32": finite_difference / jvp,
        "kl_realized_bf16_over_fp32": realised_bf16 / realised,
        "kl_guard_bf16_over_fp32": guarded.kl / guarded_fp32,
    }


def cuda_graph_sees_merge(device: torch.device) -> bool:
    """A CUDA graph captured around a linear layer replays with the weights an in-place merge wrote."""
    linear = torch.nn.Linear(256, 128, bias=False, device=device, dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(8, 256, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
        for _ in range(3):
            linear(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x)
    graph.replay()
    before = out.clone()
    merger = PayloadMerger(hf_targets({"layer": linear.weight}, "float32"))
    merger.resync({"layer": linear.weight.float()}, version=0)
    factor = (torch.randn(128, 16, device=device) * 1e-2).to(torch.bfloat16)
    entries = (PayloadEntry("layer", 128, 256, factor),)
    draft = UpdatePayload(0, 1, 1, 0, 16, "rademacher", "bfloat16", "", entries)
    fingerprint = projection_fingerprint(draft.projection(entries[0]))
    merger.apply(UpdatePayload(0, 1, 1, 0, 16, "rademacher", "bfloat16", fingerprint, entries))
    graph.replay()
    torch.cuda.synchronize(device)
    expected = linear(x)  # eager, with the merged weights
    return bool(not torch.equal(out, before) and torch.allclose(out.float(), expected.float(), rtol=1e-2, atol=1e-3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="small shapes (a CPU smoke run)")
    parser.add_argument("--out", default="bench_results", help="directory for gpu_check.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False
    small = SHAPES["small"]
    worker = train_worker_setup(device, small if args.small else SHAPES["qwen2.5-1.5b"])  # its own process group
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    memory_shape, apply_shape = (small, small) if args.small else (SHAPES["qwen2.5-1.5b"], SHAPES["qwen2.5-7b"])
    tokens = 256 if args.small else 2048
    results = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__}
    rows = []

    def record(name: str, value, unit: str = "") -> None:
        results[name] = value
        rows.append((name, f"{value:.4g}" if isinstance(value, float) else str(value), unit))
        print(f"{name:<40} {rows[-1][1]:>12} {unit}", flush=True)

    for key, value in worker.items():
        record(key, value, "s" if key.endswith("_s") else "")
    record("fsdp_backend", dist.get_backend())
    record("sketch_rel_error_bf16", sketch_vs_dense(device, small, 512))
    record("fsdp_logra_step_s", fsdp_step(device, small, 512), "s")
    for key, value in check_kernels(device, memory_shape, tokens, torch.bfloat16).items():
        record(key, value, "s")
    for key, value in projections_on_device(device, apply_shape).items():
        record(key, value, "s" if key.endswith("_s") else "")
    for key, value in kl_under_bf16(device, small, 256).items():
        record(key, value)
    if device.type == "cuda":
        record("cuda_graph_sees_merge", cuda_graph_sees_merge(device))
    variants = ("dense", "logra r=64") if args.small else ("dense", "logra r=64", "logra r=256")
    for variant in variants:
        record(f"peak_gib {variant}", peak_memory(device, memory_shape, tokens, variant.replace("logra ", "")), "GiB")
    if device.type == "cuda" and not args.small:  # the paper's claim on one GPU: dense AdamW may not fit at 7B
        for variant in ("dense", "logra r=64"):
            try:
                peak = peak_memory(device, SHAPES["qwen2.5-7b"], tokens, variant.replace("logra ", ""))
            except torch.OutOfMemoryError:
                peak = "OOM"
            torch.cuda.empty_cache()
            record(f"peak_gib 7b {variant}", peak, "GiB")
    for rank in (16, 64) if args.small else (16, 64, 256):
        for key, value in apply_time(device, apply_shape, rank).items():
            if key != "rank":
                record(f"apply r={rank} {key}", value, "s" if key.endswith("_s") else "")
    failed = failed_checks(results, cuda=device.type == "cuda")
    results["failed_checks"] = failed
    out = Path(args.out) / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    dist.destroy_process_group()
    for line in failed:
        print(f"FAILED {line}")
    sys.exit(1 if failed else 0)


def failed_checks(results: dict, cuda: bool) -> list[str]:
    """One line per check that does not hold (the docstring lists them)."""
    failed = []
    if not (results["worker_state_exact"] and results["worker_buckets_exact"]):
        failed.append("worker set-up: the sharded state or its resync buckets differ from the checkpoint")
    if not results["worker_logprob_max_abs_diff"] <= 1e-3:
        failed.append(
            f"worker log-probs differ from the reference by {results['worker_logprob_max_abs_diff']:.3g} > 1e-3"
        )
    if not results["sketch_rel_error_bf16"] < 0.05:
        failed.append(
            f"bf16 sketch error {results['sketch_rel_error_bf16']:.3g} >= 0.05 of the dense gradient's sketch"
        )
    for key in (k for k in results if k.endswith(" exact") and k.startswith("apply")):
        if not results[key]:
            failed.append(f"{key}: the in-place bf16 weights differ from bf16 of the trainer-side fp32 merge")
    if not results["projection_device_exact"]:
        failed.append("projections drawn on the device differ from the CPU's")
    for key in ("kl_fd_bf16_over_jvp_fp32", "kl_realized_bf16_over_fp32", "kl_guard_bf16_over_fp32"):
        if not 0.8 <= results[key] <= 1.25:
            failed.append(f"{key} = {results[key]:.3g}: a KL measured under bf16 is biased (want 0.8–1.25)")
    if cuda and not results.get("cuda_graph_sees_merge"):
        failed.append("a CUDA graph replay did not see the in-place merge")
    if cuda and not results["peak_gib logra r=64"] < results["peak_gib dense"]:
        failed.append(
            f"LoGRA r=64 peak {results['peak_gib logra r=64']:.3g} GiB not below dense {results['peak_gib dense']:.3g}"
        )
    return failed


def fsdp_step(device: torch.device, shape: dict, tokens: int) -> float:
    """One LoGRA step (backward, prepare, commit) of a 2-layer model under FSDP2 with bf16 compute."""
    torch.manual_seed(0)
    model = model_of(shape, layers=2).to(device)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = LoGRAOptimizer(model, LoGRAConfig(rank=64))
    ids = torch.randint(0, shape["vocab_size"], (1, tokens), device=device)
    sync(device)
    start = time.perf_counter()
    loss_of(model, ids, torch.float32).backward()
    opt.prepare(num_tokens=tokens)
    opt.commit(1.0)
    sync(device)
    return time.perf_counter() - start


def train_worker_setup(device: torch.device, shape: dict) -> dict:
    """The trainer's own set-up path (TrainWorker, 1 rank) on a 2-layer model of `shape`, fp32 compute."""
    from logra_rl.config import ClusterConfig, ModelConfig, RunConfig
    from logra_rl.rl import token_logprobs
    from logra_rl.train.batch import TrainBatch
    from logra_rl.train.worker import TrainWorker

    torch.manual_seed(3)
    reference = model_of(shape, layers=2)
    with tempfile.TemporaryDirectory() as directory:
        reference.save_pretrained(directory)
        config = RunConfig(
            model=ModelConfig(path=directory, builder=None, compute_dtype="float32"),
            cluster=ClusterConfig(train_workers=1, device=device.type),
            logra=LoGRAConfig(rank=32),
        )
        worker = TrainWorker(config, directory, rank=0, world_size=1)
        start = time.perf_counter()
        worker.setup("127.0.0.1", 29532)
        setup_s = time.perf_counter() - start
        try:
            state = worker.full_state()
            buckets = worker.resync_buckets(64 * 2**20)
            parts = {k: v for bucket in buckets for k, v in worker.full_state(bucket.keys).items()}
            ids = torch.randint(0, shape["vocab_size"], (2, 128))
            batch = TrainBatch(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                loss_mask=torch.ones(ids.shape),
                rollout_logprobs=torch.zeros(ids.shape),
                advantages=torch.zeros(2),
                completed=torch.ones(2, dtype=torch.bool),
            )
            got = worker.logprobs(batch)[:, 1:]
        finally:
            worker.shutdown()
    expected = reference.state_dict()
    with torch.no_grad():
        want = token_logprobs(reference(input_ids=ids).logits, ids, config.rollout.temperature)
    return {
        "worker_setup_s": setup_s,
        "worker_state_exact": all(torch.equal(state[k], v) for k, v in expected.items()),
        "worker_buckets_exact": all(torch.equal(parts[k], v) for k, v in expected.items()),
        "worker_logprob_max_abs_diff": float((got - want).abs().max()),
    }


if __name__ == "__main__":
    main()
