"""Peak resident memory of the CPU engine: a fresh process that loads the default model (SmolLM2-135M-Instruct,
a bf16 checkpoint) in the default CPU mode and serves a batch of 64 requests grows by less than 460 MiB over
what importing torch and pagedserve left resident (VmHWM minus VmRSS after the imports: tokenizer, weights, KV
cache and activations, all the engine's own).

The bound is on the growth, not the whole process: the imports alone measured 222 MiB on one host and 256 MiB
on another (same wheels, AMD EPYC without AVX512_BF16 both), which took a 706 MiB peak over a 700 MiB bound
that counted them; a CUDA build of torch costs more again.

Where the memory goes (bench/perf/cpu_rss_breakdown.py): tokenizer ~33 MiB, packed weights ~254 MiB (linears
202, the tied LM head's tiles 54, which also serve the embedding lookups), KV blocks of the batch 47 MiB
(bfloat16, AVX512_BF16 or AMX) or 94 MiB (float32, the default without them), and the 1,536-token prefill's
activations (the fused stack's MLP runs 256 rows at a time). Zen 3 (float32): 222 MiB imported, peak 638 MiB,
growth 417 MiB. Before weights were packed as they loaded the peak was 1,031 MiB (the float32 model and the
mmapped checkpoint held whole)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from server_process import subprocess_env  # the pagedserve the tests import (installed, or the tree's)

GROWTH_LIMIT_MIB = 460

_CHILD = r"""
import json, re, sys
from pathlib import Path
from pagedserve import LLM, SamplingParams

def status(field):
    return int(re.search(field + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024

imported = status("VmRSS")  # torch and pagedserve: the baseline the bound is over
llm = LLM(sys.argv[1], device="cpu", max_num_seqs=64)
ready = status("VmRSS")
prompts = [{"prompt_token_ids": [100 + (7 * i + 13 * j) % 20000 for j in range(24)]} for i in range(64)]
done = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
assert len(done) == 64 and all(len(o.outputs[0].token_ids) == 8 for o in done)
config = llm.llm_engine.config
print("RESULT " + json.dumps({"peak_mib": status("VmHWM"), "imported_mib": imported, "ready_mib": ready,
                              "serving_mib": status("VmRSS"), "anon_mib": status("RssAnon"),
                              "file_mib": status("RssFile"),
                              "cpu_precision": config.cpu_precision, "quantization": config.quantization}))
"""


def test_default_cpu_engine_peak_rss_at_batch_64(default_model_path: Path):
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(default_model_path)], capture_output=True, text=True,
                          timeout=300, env=subprocess_env())
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-3000:]
    result = json.loads(line[len("RESULT "):])
    growth = result["peak_mib"] - result["imported_mib"]
    assert growth < GROWTH_LIMIT_MIB, f"peak RSS {growth:.0f} MiB over the imports, bound {GROWTH_LIMIT_MIB}: {result}"

