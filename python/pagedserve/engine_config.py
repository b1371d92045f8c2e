"""EngineConfig: every knob of the engine, with the defaults vLLM users expect.

Each field carries its help text (and choices, where they are fixed) in its
metadata; the command-line flags (add_engine_args) and LLM(**options) are
generated from the fields, so a default is written once, here.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import Any, Optional

# Device-dependent defaults, decided in resolve_defaults() and nowhere else.
# A GPU step is cheap to widen (the batch rides on tensor cores), a 2-core CPU's is not.
CUDA_MAX_NUM_SEQS, CPU_MAX_NUM_SEQS = 256, 64
CUDA_TOKEN_BUDGET, CPU_TOKEN_BUDGET = 8192, 2048
CPU_KV_CACHE_GB = 1.0  # a GPU sizes its cache from gpu_memory_utilization instead
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "llguidance")  # engine/grammar.py backend_order reads them


def _knob(default: Any, help: str, *, choices: Optional[tuple] = None, metavar: Optional[str] = None,
          false_aliases: tuple[str, ...] = ()) -> Any:
    """A config field with the help text (and choices) its flag and LLM(**options) show."""
    return field(default=default, metadata={"help": help, "choices": choices, "metavar": metavar,
                                            "false_aliases": false_aliases})


@dataclass
class EngineConfig:
    model: Optional[str] = _knob(None, "local HF-format model directory (default: SmolLM2-135M-Instruct, converted "
                                       "once into ~/.cache/pagedserve)", metavar="DIR")
    dtype: str = _knob("auto", "what the model computes in; auto: the checkpoint's dtype on CUDA, float32 on CPU",
                       choices=("auto", "bfloat16", "float16", "float32"))
    device: Optional[str] = _knob(None, "where the model runs (default: cuda when available, else cpu)",
                                  choices=("cuda", "cpu"))
    load_format: str = _knob("auto", "auto: safetensors if present, else PyTorch .bin/.pt (pt); dummy: seeded "
                                     "random weights for the model's config (benchmarking)",
                             choices=("auto", "safetensors", "pt", "dummy"))
    seed: int = _knob(0, "random seed (sampling is reproducible for a given seed)")
    max_model_len: Optional[int] = _knob(None, "context limit, prompt + output tokens (default: the model's "
                                               "max_position_embeddings, lowered to what the KV cache holds)")
    block_size: int = _knob(16, "tokens per KV cache block")
    enable_prefix_caching: bool = _knob(True, "reuse the KV blocks of prompt prefixes seen before",
                                        false_aliases=("--no-prefix-caching",))
    max_num_seqs: Optional[int] = _knob(None, f"most sequences in one step (default: {CUDA_MAX_NUM_SEQS} on CUDA, "
                                              f"{CPU_MAX_NUM_SEQS} on CPU)")
    max_num_batched_tokens: Optional[int] = _knob(None, f"token budget of one step (default: {CUDA_TOKEN_BUDGET} on "
                                                        f"CUDA, {CPU_TOKEN_BUDGET} on CPU; at least max_num_seqs)")
    gpu_memory_utilization: float = _knob(0.9, "CUDA: fraction of the GPU's memory the engine may use (weights, "
                                                "activations and the KV cache)")
    kv_cache_memory_gb: Optional[float] = _knob(None, f"KV cache size in GiB (default: {CPU_KV_CACHE_GB:g} on CPU; "
                                                      "on CUDA what gpu_memory_utilization leaves)", metavar="GIB")
    num_kv_blocks: Optional[int] = _knob(None, "force the number of KV cache blocks (tests, preemption demos)")
    enforce_eager: bool = _knob(False, "CUDA: run every step eagerly, capturing no CUDA graphs")
    batch_invariant: bool = _knob(False, "CUDA: a request's tokens and logprobs bit-identical whatever else runs in "
                                         "its batch (matrix products in fixed 128-row slices, a fixed decode split; "
                                         "models/batch_invariant.py). The CPU always is")
    async_scheduling: str = _knob("auto", "schedule step N+1 and queue its forward before step N's tokens reach the "
                                          "host, so the device does not wait for the host between steps (same tokens "
                                          "and logprobs; a step with prompt logprobs, a prompt forking into n "
                                          "samples or grammar rows not on the grammar thread waits as before); "
                                          "auto: on with CUDA and one process", choices=("auto", "on", "off"))
    cpu_fused_layers: bool = _knob(True, "CPU, packed weights: run every decoder layer of a step as one C++ call "
                                         "(the same ops, bit-identical results, less Python per step)")
    cpu_weight_dtype: str = _knob("auto", "CPU, float32 models: store linear weights as bf16 tiles (auto: when that "
                                          "is lossless, as for a bf16 checkpoint; bfloat16: always, rounding; "
                                          "float32: never)", choices=("auto", "bfloat16", "float32"))
    cpu_precision: str = _knob("auto", "CPU, float32 models: float32: float32 arithmetic throughout (exact); "
                                       "bfloat16: bf16 activations into the matrix products (AVX512_BF16 / AMX) "
                                       "and a bf16 KV cache; auto: bfloat16 for a bf16 checkpoint run with dtype "
                                       "auto on a CPU with AVX512_BF16 or AMX, else float32",
                               choices=("auto", "float32", "bfloat16"))
    structured_outputs_backend: str = _knob("auto", "grammar backend of structured outputs and tool calls: auto: "
                                                    "llguidance where it takes the spec (json schemas, regexes, "
                                                    "grammars, legacy structural tags), else xgrammar; "
                                                    "xgrammar: xgrammar alone; llguidance: llguidance alone for "
                                                    "those kinds, xgrammar for choice, json_object and "
                                                    "structural tags in the format form",
                                            choices=STRUCTURED_OUTPUTS_BACKENDS)
    structured_outputs_thread: str = _knob("auto", "take the tokens of grammar steps whose rows are all under "
                                                   "llguidance, and fill their next masks, on a thread of their own "
                                                   "while the engine goes on; such steps then run ahead (same "
                                                   "tokens); auto: on where async_scheduling is",
                                           choices=("auto", "on", "off"))
    max_logprobs: int = _knob(20, "most logprobs a request may ask for per token")
    quantization: str = _knob("none", "weights kept quantized in memory: int8 (per output channel, made from any "
                                      "checkpoint at load); a .gguf model keeps its own blocks whatever this says",
                              choices=("none", "int8"))
    kv_cache_dtype: str = _knob("auto", "dtype of the KV cache (auto: the model's dtype on CUDA; on CPU bf16 "
                                        "under cpu_precision bfloat16, a bf16 model or quantized weights (GGUF, "
                                        "int8), the model's dtype in the exact float32 mode; bfloat16 under a "
                                        "float32 model halves KV memory)",
                                choices=("auto", "bfloat16", "float32"))
    tensor_parallel_size: int = _knob(1, "ranks the model is split across (column/row-parallel layers, one "
                                         "process per rank over torch.distributed: NCCL on CUDA, gloo on CPU)")
    data_parallel_size: int = _knob(1, "engine replicas behind one server (processes), requests routed to the "
                                       "least loaded with prefix affinity")

    def with_updates(self, **kw) -> "EngineConfig":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        unknown = set(kw) - set(values)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        values.update(kw)
        return EngineConfig(**values)


def option_help(f: Field) -> str:
    """A field's help text with its default, as --help and LLM's docstring show it."""
    text = f.metadata.get("help", "")
    if f.default is not None and f.default is not MISSING and "(default" not in text:
        text += f" (default: {_flag_value(f.default)})"
    return text


# CPU kernels whose bf16 dot products make cpu_precision "bfloat16" pay (ops.cpu_kernels()["bfloat16"]).
BF16_DOT_KERNELS = ("avx512_bf16", "amx_bf16")


def resolve_cpu_precision(config: EngineConfig, device_type: str, checkpoint_is_bf16: bool) -> str:
    """cpu_precision as "float32" or "bfloat16". auto is bfloat16 only where nothing asked for float32 (dtype
    and cpu_weight_dtype auto), the weights are bf16 already (a bf16 checkpoint, so only activations round)
    and the CPU has a bf16 dot product; there greedy text agrees with transformers float32 at least as often as
    transformers' own bf16 does (bench/numerics/cpu_precision_agreement.py, bench/results/cpu_precision.md)."""
    if device_type != "cpu":
        return "float32"  # a CUDA model computes in its own dtype
    if config.cpu_precision == "bfloat16" and (config.dtype not in ("auto", "float32")
                                               or config.cpu_weight_dtype == "float32"):
        raise ValueError(f"cpu_precision 'bfloat16' rounds a float32 model's activations into bf16 weight "
                         f"tiles; it needs dtype auto or float32 (got {config.dtype!r}) and cpu_weight_dtype auto "
                         f"or bfloat16 (got {config.cpu_weight_dtype!r})")
    if config.cpu_precision != "auto":
        return config.cpu_precision
    if config.dtype != "auto" or config.cpu_weight_dtype != "auto" or not checkpoint_is_bf16:
        return "float32"
    from pagedserve import ops  # the C++ extension, only where a CPU decision needs it

    return "bfloat16" if ops.cpu_kernels()["bfloat16"] in BF16_DOT_KERNELS else "float32"


def resolve_defaults(config: EngineConfig, device_type: str, max_position_embeddings: int,
                     checkpoint_is_bf16: bool = False) -> EngineConfig:
    """The config with every device-dependent default decided (the one place that decides them):
    max_num_seqs, the token budget, max_model_len (before the KV plan may lower it), the CPU KV budget,
    cpu_precision ("float32" or "bfloat16" from here on), async_scheduling and structured_outputs_thread
    ("on" or "off")."""
    cuda = device_type == "cuda"
    if config.quantization != "none" and cuda:
        raise ValueError(f"quantization {config.quantization!r} runs on the CPU only; use --device cpu or "
                         "--quantization none")
    max_num_seqs = config.max_num_seqs or (CUDA_MAX_NUM_SEQS if cuda else CPU_MAX_NUM_SEQS)
    budget = config.max_num_batched_tokens or max(CUDA_TOKEN_BUDGET if cuda else CPU_TOKEN_BUDGET, max_num_seqs)
    async_scheduling = resolve_async_scheduling(config, device_type)
    kv_gb = config.kv_cache_memory_gb
    if kv_gb is None and not cuda:
        kv_gb = CPU_KV_CACHE_GB
    return replace(config, device=device_type, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                   max_model_len=config.max_model_len or max_position_embeddings, kv_cache_memory_gb=kv_gb,
                   cpu_precision=resolve_cpu_precision(config, device_type, checkpoint_is_bf16),
                   async_scheduling=async_scheduling,
                   structured_outputs_thread=(async_scheduling if config.structured_outputs_thread == "auto"
                                              else config.structured_outputs_thread))


def resolve_async_scheduling(config: EngineConfig, device_type: str) -> str:
    """"on" or "off". The ranks of a tensor-parallel group get their input ids from the driver, not from
    samples left on their own devices, so run-ahead needs one process; on a CPU the forward runs in the
    caller's thread and there is nothing to overlap, so auto leaves it off there."""
    if config.async_scheduling == "on" and config.tensor_parallel_size > 1:
        raise ValueError(f"async_scheduling 'on' needs one process; tensor_parallel_size is "
                         f"{config.tensor_parallel_size} (use auto or off)")
    if config.async_scheduling != "auto":
        return config.async_scheduling
    return "on" if device_type == "cuda" and config.tensor_parallel_size == 1 else "off"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field: --max-num-seqs for max_num_seqs, --enable-x/--no-enable-x for a bool."""
    group = parser.add_argument_group("engine")
    types = _field_types()
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        meta = f.metadata
        if types[f.name] is bool:
            action = group.add_argument(flag, dest=f.name, default=f.default, action=argparse.BooleanOptionalAction)
            for alias in meta.get("false_aliases", ()):
                group.add_argument(alias, dest=f.name, action="store_false", help=f"same as --no-{flag[2:]}")
        else:
            kind, choices = types[f.name], meta.get("choices")
            metavar = meta.get("metavar") or (None if choices else {int: "N", float: "X"}.get(kind))
            action = group.add_argument(flag, dest=f.name, default=f.default, type=kind, choices=choices,
                                        metavar=metavar)
        action.help = option_help(f).replace("%", "%%")  # set after construction: no automatic "(default: ...)"


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def _field_types() -> dict[str, type]:
    """Each field's value type, Optional unwrapped (the annotations are strings here)."""
    import typing

    hints = typing.get_type_hints(EngineConfig)
    return {name: next((a for a in typing.get_args(hint) if a is not type(None)), hint) for name, hint in hints.items()}


def _flag_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
