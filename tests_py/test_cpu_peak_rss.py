"""Peak resident memory of the CPU engine: a fresh process that loads the default model (SmolLM2-135M-Instruct,
a bf16 checkpoint) in the default CPU mode and serves a batch of 64 requests stays under 700 MiB (VmHWM:
imports, tokenizer, loading and serving included).

Where the memory goes (bench/perf/cpu_rss_breakdown.py; AMD EPYC Zen 4, cpu_precision auto -> bfloat16):
torch and pagedserve imported ~222 MiB, tokenizer ~32 MiB, packed weights ~254 MiB (linears 202, the tied
LM head's tiles 54, which also serve the embedding lookups), KV blocks and activations of the batch ~115 MiB:
peak ~625 MiB. Before weights were packed as they loaded it was 1,031 MiB (the float32 model and the mmapped
checkpoint held whole)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from server_process import subprocess_env  # the pagedserve the tests import (installed, or the tree's)

PEAK_RSS_LIMIT_MIB = 700

_CHILD = r"""
import json, re, sys
from pathlib import Path
from pagedserve import LLM, SamplingParams

def status(field):
    return int(re.search(field + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024

imported = status("VmRSS")  # torch and pagedserve: a CUDA build of torch costs more here
llm = LLM(sys.argv[1], device="cpu", max_num_seqs=64)
ready = status("VmRSS")
prompts = [{"prompt_token_ids": [100 + (7 * i + 13 * j) % 20000 for j in range(24)]} for i in range(64)]
done = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
assert len(done) == 64 and all(len(o.outputs[0].token_ids) == 8 for o in done)
config = llm.llm_engine.config
print("RESULT " + json.dumps({"peak_mib": status("VmHWM"), "imported_mib": imported, "ready_mib": ready,
                              "serving_mib": status("VmRSS"),
                              "cpu_precision": config.cpu_precision, "quantization": config.quantization}))
"""


def test_default_cpu_engine_peak_rss_at_batch_64(default_model_path: Path):
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(default_model_path)], capture_output=True, text=True,
                          timeout=300, env=subprocess_env())
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-3000:]
    result = json.loads(line[len("RESULT "):])
    assert result["peak_mib"] < PEAK_RSS_LIMIT_MIB, f"peak RSS over {PEAK_RSS_LIMIT_MIB} MiB: {result}"

