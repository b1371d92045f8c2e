"""The bench scripts run end to end at --quick sizes and write the results they promise.

Each script runs as its own subprocess (nothing shared), on the CPU, into a
temporary folder; the checks are on the shape of what it saved (JSON keys,
markdown, plots) and on invariants every run must satisfy, not on speed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve import ops

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
DEMOS = ("waste", "latency", "block_table", "prefix_sharing", "parallel_sampling", "preemption")


def run_script(script: str, *args: str, timeout: int = 240) -> str:
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, f"{script} {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def load(out: Path, name: str) -> dict:
    md = (out / f"{name}.md").read_text()
    assert md.strip(), f"{name}.md is empty"
    data = json.loads((out / f"{name}.json").read_text())
    assert {"date", "platform", "torch"} <= set(data["machine"]), "every result records its machine"
    assert {"processor", "pagedserve_cpu_isa"} <= set(data["machine"]), "and its CPU model and ISA"
    versions = data["versions"]
    assert {"pagedserve", "pagedserve_commit", "torch"} <= set(versions), "and the versions of what it ran"
    assert f"pagedserve {versions['pagedserve']} ({versions['pagedserve_commit']})" in md.splitlines()[0]
    return data


SCRIPTS = ["perf/throughput.py", "perf/memory_bench.py", "perf/long_workload.py", "perf/kernel_bench.py",
           "perf/scheduler_bench.py", "perf/step_timing.py", "perf/decode_kernels.py", "perf/serve_bench.py", "perf/cpu_ops_bench.py",
           "perf/cpu_dtype_bench.py", "perf/bench_sampler.py", "perf/cli_startup.py", "perf/structured_bench.py", "perf/moe_bench.py",
           "perf/dp_bench.py", "perf/window_kv_bench.py", "perf/step_overhead_bench.py", "perf/small_batch_linear_bench.py",
           "perf/gguf_bench.py", "perf/cpu_serving_bench.py", "perf/cpu_rss_breakdown.py", "perf/tp_bench.py",
           "perf/tp_comm_model.py", "perf/dp_engine_bench.py", "perf/cpu_weight_streaming.py",
           "perf/cpu_step_profile.py", "perf/probes/cpu_decode_rounds.py", "perf/probes/tile_kernels_by_level.py",
           "perf/probes/dense_products_in_graphs.py", "perf/probes/step_phases.py", "perf/probes/llguidance_c_api.py",
           "perf/probes/llguidance_parallel_fill.py",
           "demos/demos.py", "make_results.py", "numerics/bf16_agreement.py", "numerics/cpu_precision_agreement.py",
           "numerics/tp_agreement.py",
           "numerics/sdpa_numerics.py",
           "numerics/norm_numerics.py", "numerics/softmax_numerics.py"]


def test_the_script_list_covers_bench():
    found = {p.relative_to(BENCH).as_posix() for p in BENCH.rglob("*.py")
             if not any(part.startswith("_") or part == "common" for part in p.relative_to(BENCH).parts)}
    assert found == set(SCRIPTS)


# Scripts a test below runs with --quick (so they parse it and run end to end): --help adds nothing for them
# but a torch import (2-4 s each).
RUN_QUICK = {"perf/throughput.py", "perf/gguf_bench.py", "perf/memory_bench.py", "demos/demos.py",
             "perf/long_workload.py", "perf/window_kv_bench.py", "perf/step_overhead_bench.py",
             "perf/cpu_weight_streaming.py", "perf/cpu_serving_bench.py", "perf/cpu_rss_breakdown.py",
             "perf/cpu_step_profile.py",
             "perf/cpu_ops_bench.py", "perf/bench_sampler.py", "perf/dp_bench.py", "perf/dp_engine_bench.py",
             "perf/tp_bench.py", "perf/tp_comm_model.py"}


def test_every_script_runs_quick_or_has_help_that_offers_it():
    assert RUN_QUICK < set(SCRIPTS)
    calls = [line for line in Path(__file__).read_text().splitlines() if line.strip().startswith("run_script(")]
    for script in RUN_QUICK:
        assert any(f'run_script("{script}",' in line and '"--quick"' in line for line in calls), script


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s not in RUN_QUICK])
def test_every_script_has_help(script):
    out = run_script(script, "--help", timeout=60)
    assert "usage:" in out and "--quick" in out


def test_committed_results_record_the_versions_they_compare():
    paths = sorted(BENCH.glob("results/*.json")) + sorted(BENCH.glob("results/*/*.json"))
    assert paths
    for path in paths:
        data = json.loads(path.read_text())
        assert {"pagedserve", "pagedserve_commit", "torch"} <= set(data["versions"]), path
        rows = data.get("rows", [])
        compared = any(row.get("engine", "pagedserve") != "pagedserve" for row in rows) or not rows
        if path.stem.startswith(("throughput_", "cpu_throughput_", "bf16_agreement")) and compared:
            assert "transformers" in data["versions"], path  # a --no-hf run compares nothing
        assert "processor" in data["machine"] or "gpu" in data["machine"], path


def test_throughput_quick(tmp_path):
    run_script("perf/throughput.py", "--quick", "--device", "cpu", "--plot", "--out", str(tmp_path))
    data = load(tmp_path, "throughput_cpu_SmolLM2-135M-Instruct_quick")
    assert "transformers" in data["versions"], "a run against transformers records its version"
    assert (tmp_path / "throughput_cpu_SmolLM2-135M-Instruct_quick.png").stat().st_size > 0
    engines = {(r["engine"], r["concurrency"]) for r in data["rows"]}
    for c in (1, 4):
        assert {("pagedserve", c), ("transformers-sequential", c), ("transformers-static-batch", c)} <= engines
    for r in data["rows"]:
        assert r["output_tok_s"] > 0 and r["ms_per_output_token"] > 0
        if r["engine"] == "pagedserve":
            assert 0 < r["kv_peak_used_gib"] <= r["kv_pool_gib"]


def test_gguf_bench_quick(tmp_path):
    run_script("perf/gguf_bench.py", "--quick", "--out", str(tmp_path))
    data = load(tmp_path, "gguf_quick")
    interleaved = {"Q4_1 interleaved", "Q8_0 interleaved"} if ops.cpu_isa() != "baseline" else set()
    assert {r["format"] for r in data["kernels"]} == {"bf16 tiles", "Q4_1", "Q8_0"} | interleaved
    assert all(r["gb_s"] > 0 for r in data["kernels"])
    assert set(data["decode"]["ms_per_token"]) == {"Q4_1 GGUF", "Q4_1 GGUF, file layout", "bf16"}
    assert data["decode"]["file_layout_over_interleaved_time_ratio"] > 0


def test_memory_bench_quick(tmp_path):
    run_script("perf/memory_bench.py", "--quick", "--out", str(tmp_path))
    data = load(tmp_path, "memory_quick")
    assert (tmp_path / "memory_quick.png").stat().st_size > 0
    rows = {r["scheme"].split(" ")[0]: r for r in data["rows"]}
    assert set(rows) == {"pagedserve", "grow-by-copy", "contiguous"}
    assert rows["pagedserve"]["max_waste_per_seq"] < 16, "paged waste is under one block per sequence"
    for r in rows.values():
        assert 0 < r["utilization"] <= 1 and r["mean_used_gib"] <= r["mean_reserved_gib"] <= r["memory_gib"]
    assert rows["pagedserve"]["seqs_fit"] > rows["contiguous"]["seqs_fit"]
    assert rows["contiguous"]["preemptions"] == 0, "a max_model_len reservation never grows"
    final = {r["scheme"].split(" ")[0]: r for r in data["final_length"]}
    assert final["pagedserve"]["reserved_tokens"] <= final["grow-by-copy"]["reserved_tokens"] \
        <= final["contiguous"]["reserved_tokens"]


def test_demos_quick(tmp_path):
    run_script("demos/demos.py", "all", "--quick", "--device", "cpu", "--out", str(tmp_path))
    demos = {name: load(tmp_path, f"demo_{name}_quick") for name in DEMOS}
    waste = demos["waste"]["summary"]
    assert waste["row_steps_needed"] <= waste["row_steps_static"]
    assert all(r["static_batch_steps"] >= r["steps_needed"] for r in demos["waste"]["rows"])
    assert len(demos["latency"]["rows"]) == 8
    static, continuous = demos["latency"]["totals"]
    assert continuous["mean_steps"] < static["mean_steps"], "continuous batching finishes requests sooner"
    table = demos["block_table"]
    assert table["one_sequence"] and table["pool_snapshots"]
    assert all(len(s["pool"]) == 48 for s in table["pool_snapshots"])
    prefix = {r["prefix_cache"]: r for r in demos["prefix_sharing"]["rows"]}
    assert prefix["on"]["hit_rate_one_by_one"] > 0 == prefix["off"]["hit_rate_one_by_one"]
    assert demos["prefix_sharing"]["blocks_saved_burst"] > 0
    sampling = demos["parallel_sampling"]
    forked, independent = sampling["rows"][-1], sampling["rows"][0]
    assert forked["peak_kv_blocks"] == sampling["expected_forked_blocks"]
    assert independent["peak_kv_blocks"] == sampling["expected_independent_blocks"]
    preemption = demos["preemption"]
    assert preemption["rows"][1]["preemptions"] > 0
    assert preemption["same_outputs"] == preemption["rows"][1]["completed"] and not preemption["failures"]


def test_long_workload_quick(tmp_path):
    # The default model's shape, not the Qwen3-0.6B (whose 2.4 GB of float32 dummy weights took a minute
    # of CI to make and run): the check is that the script runs end to end and saves what it promises.
    run_script("perf/long_workload.py", "--quick", "--device", "cpu", "--shape", "smollm2-135m", "--num-requests",
               "4", "--min-len", "8", "--max-len", "16", "--out", str(tmp_path))
    row = load(tmp_path, "long_workload_cpu_quick")["row"]
    assert row["model"] == "smollm2-135m" and row["requests"] == 4
    assert row["output_tok_s"] > 0 and row["output_tokens"] >= 4 * 8


def test_window_kv_bench_quick(tmp_path):
    run_script("perf/window_kv_bench.py", "--quick", "--out", str(tmp_path))
    data = load(tmp_path, "window_kv_cpu_quick")
    assert (tmp_path / "window_kv_cpu_quick.png").stat().st_size > 0
    window, full = data["rows"]
    assert window["kv_window"] == data["window"] and full["kv_window"] == 0
    assert window["peak_blocks_held"] == data["theoretical_window_blocks"], "a windowed sequence stays flat"
    assert full["final_blocks_held"] == full["blocks_without_freeing"] > window["peak_blocks_held"]
    assert window["output_tokens"] == full["output_tokens"] == data["max_tokens"]
    assert window["tokens_per_s"] > 0 and full["tokens_per_s"] > 0


def test_step_overhead_bench_quick(tmp_path):
    run_script("perf/step_overhead_bench.py", "--quick", "--out", str(tmp_path))
    data = load(tmp_path, "step_overhead_default_quick")
    fused, per_op = data["rows"]
    assert (fused["path"], per_op["path"]) == ("fused", "per-op") and fused["batch"] == per_op["batch"] == 1
    assert fused["ms_per_step"] > 0 and per_op["ms_per_step"] > 0 and len(fused["rounds_ms"]) == data["rounds"]
    assert fused["op_calls"] < 10 < 30 * 10 < per_op["op_calls"], "one call for the layers, ~11 per layer"


def test_cpu_weight_streaming_quick(tmp_path):
    run_script("perf/cpu_weight_streaming.py", "--quick", "--out", str(tmp_path))
    data = load(tmp_path, "cpu_weight_streaming_quick")
    rows = {row["what"]: row for row in data["rows"]}
    assert len(rows) == (7 if ops.cpu_isa() != "baseline" else 6)  # no interleaved GGUF kernels below AVX2
    assert all(row["best_gb_s"] > 0 and row["best_ms"] <= row["median_ms"] for row in rows.values())
    assert rows["read"]["share_of_read"] == 1.0
    bf16, int8 = rows["packed_linear (float32 x)"], rows["int8_linear"]
    assert bf16["mb_streamed"] == 2 * int8["mb_streamed"], "int8 channels are half the bytes of bf16 tiles"
    # Q4_1 layers (20 bytes a 32-weight block) and a Q8_0 head (34 bytes): 4 layers and the head.
    layers, head = 4 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536), 49152 * 576
    assert rows["gguf_linear (file layout)"]["mb_streamed"] == (layers * 20 + head * 34) / 32 / 1e6


def test_cpu_step_profile_quick(tmp_path):
    """The per-op mode makes one int8_linear call per linear (30 layers x 4 + the LM head); the fused stack
    makes one, the LM head's."""
    run_script("perf/cpu_step_profile.py", "--quick", "--out", str(tmp_path))
    data = load(tmp_path, "cpu_step_profile_smollm2-135m_quick")
    assert [row["mode"] for row in data["summary"]] == ["int8", "int8_perop"]
    assert all(row["median_ms_per_token"] > 0 for row in data["summary"])
    linear = {row["mode"]: row for row in data["calls"] if row["call"] == "ops.int8_linear"}
    assert linear["int8_perop"]["calls_per_token"] == 121 and linear["int8"]["calls_per_token"] == 1


def test_step_overhead_bench_int8_quick(tmp_path):
    """int8 channels run in the stack too: one op call for the layers."""
    run_script("perf/step_overhead_bench.py", "--quick", "--quantization", "int8", "--out", str(tmp_path))
    fused, per_op = load(tmp_path, "step_overhead_default_int8_quick")["rows"]
    assert fused["quantization"] == per_op["quantization"] == "int8"
    assert fused["op_calls"] < 10 < 30 * 10 < per_op["op_calls"], "one call for the layers, ~11 per layer"


def test_cpu_serving_bench_quick(tmp_path):
    # Three of the modes (each is a child process that loads the model): the others differ only in LLM options
    run_script("perf/cpu_serving_bench.py", "--quick", "--modes", "pagedserve float32,pagedserve bf16-kv,"
               "transformers bf16", "--out", str(tmp_path), timeout=600)
    data = load(tmp_path, "cpu_serving_quick")
    assert "transformers" in data["versions"], "a run against transformers records its version"
    assert (tmp_path / "cpu_serving_quick.png").stat().st_size > 0
    modes = {m["mode"]: m for m in data["modes"]}
    assert {"pagedserve float32", "transformers bf16"} <= set(modes)
    assert modes["pagedserve float32"]["kv_dtype"] == "float32" and modes["pagedserve float32"]["ops_isa"]
    assert set(modes) == {"pagedserve float32", "pagedserve bf16-kv", "transformers bf16"}
    assert modes["pagedserve bf16-kv"]["kv_dtype"] == "bfloat16"
    for r in data["rows"]:
        assert r["output_tok_s"] > 0 and r["serving_rss_mib"] > 0 and r["batch"] in (1, 4)
        if r["mode"] != "pagedserve float32":
            assert r["x_vs_float32"] > 0
    assert all(m["ttft_s"] > 0 and m["peak_rss_mib"] > 0 for m in modes.values())


def test_cpu_serving_bench_runs_a_shape_on_random_weights(tmp_path):
    """--shape: no wheel needed (a GPU host's CPU); the same modes, named as random weights."""
    run_script("perf/cpu_serving_bench.py", "--quick", "--shape", "smollm2-135m", "--modes",
               "pagedserve float32,transformers bf16", "--out", str(tmp_path), timeout=600)
    data = load(tmp_path, "cpu_serving_smollm2-135m_quick")
    assert data["model"] == "smollm2-135m shape, random weights"
    modes = {m["mode"]: m for m in data["modes"]}
    assert set(modes) == {"pagedserve float32", "transformers bf16"}
    assert modes["pagedserve float32"]["linear_kernels"] == ["PackedBf16"], "bf16 tiles, as for the real checkpoint"
    assert all(r["output_tok_s"] > 0 for r in data["rows"])


def test_cpu_rss_breakdown_quick(tmp_path):
    run_script("perf/cpu_rss_breakdown.py", "--quick", "--out", str(tmp_path), timeout=300)
    data = load(tmp_path, "cpu_rss_breakdown_quick")
    rows = data["modes"]["bfloat16"]["rows"]
    assert [r["stage"] for r in rows] == ["imports", "tokenizer", "weights", "packing", "engine ready",
                                          "batch 4 x 2 tokens"]
    assert all(0 < r["rss_mib"] <= r["stage_peak_mib"] + 1 and r["stage_peak_mib"] <= r["hwm_mib"] + 1 for r in rows)
    assert rows[-1]["hwm_mib"] == max(r["hwm_mib"] for r in rows)


def test_cpu_op_and_sampler_benches_quick(tmp_path):
    run_script("perf/cpu_ops_bench.py", "--quick", "--out", str(tmp_path))
    ops = load(tmp_path, "cpu_ops_quick")
    assert ops["results"] and all(r["pagedserve_us"] > 0 and r["torch_us"] > 0 for r in ops["results"])
    run_script("perf/bench_sampler.py", "--quick", "--device", "cpu", "--out", str(tmp_path))
    sampler = load(tmp_path, "sampler_cpu_quick")
    assert {r["case"] for r in sampler["rows"]} >= {"greedy (fast path)", "mixed"}
    assert all(r["median_ms"] > 0 for r in sampler["rows"])


def test_dp_bench_quick(tmp_path):
    run_script("perf/dp_bench.py", "--quick", "--workloads", "shared_prefix", "--serve-args",
               "--device cpu --max-model-len 512 --kv-cache-memory-gb 0.25", "--out", str(tmp_path), timeout=600)
    rows = load(tmp_path, "dp_cpu_quick")["results"]
    assert [r["data_parallel_size"] for r in rows] == [1, 2]
    assert all(r["completed"] == 16 and r["failed"] == 0 and r["output_token_throughput"] > 0 for r in rows)
    assert len(rows[1]["replicas"]) == 2 and sum(r["prompt_tokens"] for r in rows[1]["replicas"]) == 16 * 32


def test_dp_engine_bench_quick(tmp_path):
    run_script("perf/dp_engine_bench.py", "--quick", "--out", str(tmp_path), timeout=600)
    data = load(tmp_path, "dp_engine_cpu_default_quick")
    rows = data["rows"]
    assert [r["data_parallel_size"] for r in rows] == [1, 2]
    assert all(r["requests"] == 8 and r["output_tokens"] == 8 * data["output_len"] and r["output_tok_s"] > 0
               for r in rows)
    assert rows[0]["x_vs_dp1"] == 1.0


def test_make_results_renders_every_result(tmp_path):
    shutil.copytree(BENCH / "results", tmp_path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("RESULTS.md", "raw"))
    run_script("perf/memory_bench.py", "--quick", "--no-plot", "--out", str(tmp_path))
    run_script("demos/demos.py", "block-table", "--quick", "--out", str(tmp_path))
    run_script("make_results.py", "--out", str(tmp_path))
    text = (tmp_path / "RESULTS.md").read_text()
    assert "do not edit" in text
    for json_file in list(tmp_path.glob("*.json")) + list(tmp_path.glob("*/*.json")):
        assert json_file.relative_to(tmp_path).as_posix() in text, f"{json_file.name} is not in RESULTS.md"
    assert "## Exact figures" in text and "memory_quick.json" in text
    for png in text.split("](")[1:]:
        target = png.split(")")[0]
        if target.endswith(".png"):
            assert (tmp_path / target).exists(), f"RESULTS.md links a missing plot {target}"


def test_tp_bench_quick(tmp_path):
    run_script("perf/tp_bench.py", "--quick", "--batch", "2", "--steps", "3", "--out", str(tmp_path), timeout=600)
    rows = load(tmp_path, "tp_cpu_default_quick")["rows"]
    assert [r["tp"] for r in rows] == [1, 2]
    tp1, tp2 = rows
    assert tp1["all_reduce_calls_per_step"] == 0
    # SmolLM2: 30 layers x 2 row-parallel all-reduces + the embedding's, every decode step
    assert tp2["all_reduce_calls_per_step"] == 61 and tp2["gather_calls_per_step"] == 1
    assert 0 < tp2["all_reduce_share"] <= tp2["collective_share"] <= 1


def test_tp_comm_model_quick(tmp_path):
    run_script("perf/tp_comm_model.py", "--quick", "--out", str(tmp_path))
    rows = load(tmp_path, "tp_comm_model_H100_quick")["rows"]
    llama8b = {(r["tp"], r["tokens"]): r for r in rows if r["model"] == "Llama-3-8B"}
    assert llama8b[(2, 1)]["all_reduces"] == 65 and llama8b[(2, 1)]["KiB_per_all_reduce"] == 8.0
    assert llama8b[(8, 256)]["comm_share"] > llama8b[(2, 256)]["comm_share"]  # less compute per GPU, more hops
