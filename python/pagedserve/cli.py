"""The `pagedserve` command: generate, chat, serve.

    pagedserve generate "The capital of France is"
    pagedserve chat
    pagedserve serve --port 8000
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pagedserve.engine_config import add_engine_args, engine_config_from_args


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1, help="completions per prompt (parallel sampling)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args: argparse.Namespace):
    from pagedserve.sampling_params import SamplingParams
    return SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.seed, max_tokens=args.max_tokens, stop=args.stop,
                          ignore_eos=args.ignore_eos)


def _engine(args: argparse.Namespace):
    from pagedserve.engine import LLMEngine
    return LLMEngine(engine_config_from_args(args))


def _stream(engine, request_id: str, prompt, params, out=sys.stdout) -> tuple[list[str], int, float]:
    """Runs one request to completion, streaming text when n == 1. Returns (texts, tokens, seconds)."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    texts = [""] * params.n
    tokens = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            for c in delta.outputs:
                texts[c.index] += c.text
                tokens += len(c.token_ids)
                if params.n == 1 and c.text:
                    out.write(c.text)
                    out.flush()
    if params.n > 1:
        for i, text in enumerate(texts):
            out.write(f"\n--- completion {i} ---\n{text}")
    out.write("\n")
    return texts, tokens, time.perf_counter() - start


def cmd_generate(args: argparse.Namespace) -> int:
    engine = _engine(args)
    params = _sampling_params(args)
    prompt = args.prompt
    if args.chat_template:
        from pagedserve.tokenizer import apply_chat_template
        prompt = {"prompt_token_ids": apply_chat_template(engine.tokenizer, [{"role": "user", "content": prompt}])}
    else:
        sys.stdout.write(args.prompt)
    _, tokens, seconds = _stream(engine, "generate-0", prompt, params)
    print(f"[{tokens} tokens in {seconds:.2f} s, {tokens / max(seconds, 1e-9):.1f} tok/s on "
          f"{engine.worker.device}]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedserve.tokenizer import apply_chat_template
    engine = _engine(args)
    params = _sampling_params(args)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("Chat with the model. /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        ids = apply_chat_template(engine.tokenizer, history, add_generation_prompt=True)
        try:
            texts, _, _ = _stream(engine, f"chat-{turn}", {"prompt_token_ids": ids}, params)
        except ValueError as err:  # e.g. the conversation outgrew max_model_len
            print(f"error: {err}", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": texts[0]})
        turn += 1


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedserve.server.app import serve
    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt, streaming to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--chat-template", action="store_true", help="wrap the prompt as a user chat message")
    _add_sampling_args(gen, max_tokens=64)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(chat, max_tokens=256)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    serve.add_argument("--served-model-name", default=None, help="model name in the API (default: the directory name)")
    serve.add_argument("--max-num-waiting", type=int, default=4096, help="queue length at which requests get 503")
    serve.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body accepted")
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as err:
        print(f"pagedserve: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
