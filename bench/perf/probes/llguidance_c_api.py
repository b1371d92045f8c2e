"""Whether llguidance's C API, which its Python wheel's library exports, gives the masks its Python LLMatcher
gives: the question before a grammar worker in C++ (no GIL) could take the grammar thread's jobs
(engine/grammar_thread.py; bench/results/h200/session38.md).

The C tokenizer is built from the model's tokenizer.json by llguidance's own parser (the Python one by the
tokenizers crate) and tokenizes approximately (greedy); the probe walks random allowed tokens through both
matchers under structured_bench's JSON schema and counts the masks that differ, with each side's time a mask.

    python bench/perf/probes/llguidance_c_api.py [--steps 400] [--seed 0]
    python bench/perf/probes/llguidance_c_api.py --quick     # 20 steps: checks the script works

Exit status 1 where a mask or an accept differs. The structs are those of llguidance 1.8's llguidance.h
(the tokenizer's carries its own size; the constraint defaults are written into a larger zeroed buffer).
"""

from __future__ import annotations

import argparse
import ctypes
import random
import sys
import time
from copy import copy
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from structured_bench import LONG_SCHEMA  # noqa: E402

import torch  # noqa: E402


class TokenizerInitV2(ctypes.Structure):  # LlgTokenizerInitV2
    _fields_ = [("struct_size", ctypes.c_size_t), ("vocab_size", ctypes.c_uint32), ("tok_eos", ctypes.c_uint32),
                ("token_lens", ctypes.c_void_p), ("token_bytes", ctypes.c_void_p), ("tokenizer_json", ctypes.c_char_p),
                ("tokenize_assumes_string", ctypes.c_bool), ("tokenize_fn", ctypes.c_void_p),
                ("use_approximate_greedy_tokenize_fn", ctypes.c_bool), ("tokenize_user_data", ctypes.c_void_p),
                ("slices", ctypes.c_void_p), ("tok_eos_extra", ctypes.c_void_p),
                ("tok_eos_extra_count", ctypes.c_uint32)]


def c_api():
    import llguidance._lib

    lib = ctypes.CDLL(llguidance._lib.__file__)
    lib.llg_new_tokenizer_v2.restype = ctypes.c_void_p
    lib.llg_new_matcher.restype = ctypes.c_void_p
    lib.llg_matcher_get_error.restype = ctypes.c_char_p
    lib.llg_matcher_get_error.argtypes = [ctypes.c_void_p]
    lib.llg_matcher_get_mask_byte_size.restype = ctypes.c_size_t
    lib.llg_matcher_get_mask_byte_size.argtypes = [ctypes.c_void_p]
    lib.llg_matcher_compute_mask_into.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.llg_matcher_consume_token.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="20 steps: checks the script works")
    args = ap.parse_args()
    steps = 20 if args.quick else args.steps
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from pagedserve import StructuredOutputsParams
    from pagedserve.engine.grammar_backends import LLGuidanceBackend
    from pagedserve.models.default_model import model_path

    model_dir = model_path(None)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    vocab, eos = 49152, tokenizer.eos_token_id
    backend = copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    lib = c_api()
    init = TokenizerInitV2(struct_size=ctypes.sizeof(TokenizerInitV2), vocab_size=vocab, tok_eos=eos,
                           tokenizer_json=backend.to_str().encode(), use_approximate_greedy_tokenize_fn=True)
    error = ctypes.create_string_buffer(1024)
    c_tokenizer = lib.llg_new_tokenizer_v2(ctypes.byref(init), error, len(error))
    if not c_tokenizer:
        sys.exit(f"llg_new_tokenizer_v2: {error.value.decode()}")
    constraint_init = ctypes.create_string_buffer(4096)  # LlgConstraintInit, whatever its size in this version
    lib.llg_constraint_init_set_defaults(constraint_init, ctypes.c_void_p(c_tokenizer))
    grammar = LLGuidanceBackend.grammar_text(StructuredOutputsParams(json=LONG_SCHEMA))  # as the engine compiles it
    c_matcher = lib.llg_new_matcher(constraint_init, b"llguidance", grammar.encode())
    if lib.llg_matcher_get_error(c_matcher):
        sys.exit(f"llg_new_matcher: {lib.llg_matcher_get_error(c_matcher).decode()}")
    py_matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=[eos]),
                                      grammar, log_level=0)
    words = (vocab + 31) // 32
    nbytes = lib.llg_matcher_get_mask_byte_size(c_matcher)
    c_mask, py_mask = torch.zeros(words, dtype=torch.int32), torch.zeros(words, dtype=torch.int32)
    rng, differing, walked, c_seconds, py_seconds = random.Random(args.seed), 0, 0, 0.0, 0.0
    for _ in range(steps):
        start = time.perf_counter()
        if lib.llg_matcher_compute_mask_into(c_matcher, c_mask.data_ptr(), nbytes) != 0:
            sys.exit(f"llg_matcher_compute_mask_into: {lib.llg_matcher_get_error(c_matcher).decode()}")
        c_seconds += time.perf_counter() - start
        start = time.perf_counter()
        py_matcher.unsafe_compute_mask_ptr(py_mask.data_ptr(), words * 4)
        py_seconds += time.perf_counter() - start
        differing += not torch.equal(c_mask, py_mask)
        bits = py_mask.numpy().view("uint32")
        allowed = [t for t in range(vocab) if (bits[t >> 5] >> (t & 31)) & 1]
        if not allowed or py_matcher.is_stopped():
            break
        token = rng.choice(allowed)
        if (lib.llg_matcher_consume_token(c_matcher, token) == 0) != py_matcher.consume_token(token):
            print(f"token {token}: the matchers disagree whether it is accepted")
            differing += 1
            break
        walked += 1
    print(f"llguidance {llguidance.__version__ if hasattr(llguidance, '__version__') else '?'}: {walked} random "
          f"allowed tokens walked, {differing} masks differing; a mask took {1e6 * c_seconds / max(walked, 1):.1f} us "
          f"(C API) / {1e6 * py_seconds / max(walked, 1):.1f} us (Python LLMatcher) on this host")
    sys.exit(1 if differing else 0)


if __name__ == "__main__":
    main()
