"""What the engine demos share: the engine options, building an engine, prompts,
and running requests while recording the scheduler's state after every schedule()."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# Plain words that random prompts are drawn from: readable text keeps greedy
# decoding on real weights far from ties, unlike random token ids.
WORDS = ("the river runs past an old mill where children count boats and the baker sells warm bread while "
         "engineers draw bridges over quiet water under a grey sky of early spring and the town keeps its "
         "clock tower bright with lamps that sailors watch from the harbour wall at night").split()


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    import torch
    g = ap.add_argument_group("engine")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    g.add_argument("--shape", default=None, help="dummy-weight model shape instead (bench/model_shapes.py)")
    g.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                   help="CUDA: the share of the card each demo engine may take (they run one after another)")


def model_source(args) -> tuple[str, str, str]:
    """(model directory, load_format, label) from --model / --shape."""
    if args.shape:
        from common.model_shapes import shape_dir
        return str(shape_dir(args.shape)), "dummy", args.shape
    if args.model:
        return args.model, "auto", Path(args.model).name
    from pagedserve.models.default_model import default_model_dir
    path = default_model_dir()
    return str(path), "auto", path.name


def make_llm(args, dtype: str | None = None, **options):
    from pagedserve import LLM
    model, load_format, _ = model_source(args)
    cuda = args.device.startswith("cuda")
    dtype = dtype or args.dtype or ("bfloat16" if cuda else "float32")
    if cuda and options.get("num_kv_blocks") is None:
        options.setdefault("gpu_memory_utilization", args.gpu_memory_utilization)
    return LLM(model, dtype=dtype, device=args.device, load_format=load_format, **options)


def warm_up(llm) -> None:
    from pagedserve import SamplingParams
    llm.generate([{"prompt_token_ids": [11, 12, 13, 14]}], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)


class PromptMaker:
    """Prompts of exact token counts for the model named by the args, without loading its weights."""

    def __init__(self, args):
        import json
        model, _, _ = model_source(args)
        path = Path(model)
        self.vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
        self.tokenizer = None
        if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            from pagedserve.engine.tokenizer import load_tokenizer
            self.tokenizer = load_tokenizer(path)

    def text(self, num_tokens: int, rng: np.random.Generator) -> list[int]:
        """num_tokens tokens of plain words (random ids when the model has no tokenizer)."""
        if self.tokenizer is None:
            return rng.integers(100, min(self.vocab_size, 30000), size=num_tokens).tolist()
        ids: list[int] = []
        while len(ids) < num_tokens:
            ids += self.tokenizer.encode(" ".join(rng.choice(WORDS, size=num_tokens)), add_special_tokens=False)
        return ids[:num_tokens]


@dataclass
class StepRecord:
    time: float
    num_running: int
    num_waiting: int
    num_used_blocks: int
    blocks_saved_by_sharing: int


class RecordingScheduler:
    """Stands in for the engine's scheduler and notes its state after each schedule(),
    when the step's blocks are held: the peak a demo reports."""

    def __init__(self, scheduler):
        self._scheduler = scheduler
        self.records: list[StepRecord] = []

    def schedule(self):
        step = self._scheduler.schedule()
        s = self._scheduler.stats()
        self.records.append(StepRecord(time.perf_counter(), s["num_running"], s["num_waiting"],
                                       s["num_used_blocks"], s["blocks_saved_by_sharing"]))
        return step

    def __getattr__(self, name):
        return getattr(self._scheduler, name)

    def peak(self, attr: str) -> int:
        return max((getattr(r, attr) for r in self.records), default=0)


@dataclass
class Run:
    outputs: list                  # RequestOutput per request, in submission order
    wall_s: float
    records: list[StepRecord] = field(default_factory=list)
    stats_delta: dict = field(default_factory=dict)  # scheduler counters gained during the run
    # Engine steps run when each request's final output came back (outputs trail tokens by up to one step).
    finish_steps: list[int] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return sum(len(c.token_ids) for o in self.outputs for c in o.outputs)

    def peak(self, attr: str) -> int:
        return max((getattr(r, attr) for r in self.records), default=0)


COUNTERS = ("num_preemptions", "num_preempted_tokens", "prefix_queried_blocks", "prefix_hit_blocks")


def run_requests(llm, prompts: list[list[int]], params, desc: str = "requests") -> Run:
    """Submits every prompt at once and steps the engine until all finish, recording each step."""
    from tqdm.auto import tqdm
    engine = llm.llm_engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    before = engine.stats()
    recorder = RecordingScheduler(engine.scheduler)
    engine.scheduler = recorder
    finals: dict[str, object] = {}
    finished_at: dict[str, int] = {}
    ids = [f"{desc}-{i}-{time.perf_counter_ns()}" for i in range(len(prompts))]
    try:
        start = time.perf_counter()
        for rid, prompt, p in zip(ids, prompts, params):
            engine.add_request(rid, {"prompt_token_ids": prompt}, p, stream=False)
        with tqdm(total=len(ids), desc=desc, dynamic_ncols=True, leave=False) as bar:
            while len(finals) < len(ids):
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                        finished_at[out.request_id] = len(recorder.records)
                        bar.update(1)
        wall = time.perf_counter() - start
    finally:
        engine.scheduler = recorder._scheduler
    after = engine.stats()
    delta = {k: after[k] - before[k] for k in COUNTERS}
    return Run([finals[rid] for rid in ids], wall, recorder.records, delta, [finished_at[rid] for rid in ids])


def token_ids(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def engine_label(args) -> str:
    _, _, label = model_source(args)
    return f"{label} on {args.device}"
